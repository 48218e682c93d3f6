"""What admitting one Generate request costs the frontend's event loop, inline and on the
admission pool, by prompt size: the numbers behind admission_pool's INLINE_TEXT_CHARS.

`python -m bench.admission_cost [--model DIR] [--out FILE]` (unset --model: the tiny seeded
checkpoint, written to a temporary directory). For each text size it reports the wall time of
validation (with tokenizing) run inline, the same through the pool (a thread hop there and back),
and the longest the event loop was blocked meanwhile (a ticker task measures it).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import pathlib
import random
import statistics
import tempfile
import time

from common.pb.llm.v1 import generation_pb2
from scheduler_svc.frontend.admission_pool import AdmissionPool
from scheduler_svc.frontend.tokenizer import load_tokenizer
from scheduler_svc.frontend.validation import validate_request

SIZES = (64, 256, 1024, 4096, 65536, 1 << 20)


def _text(num_bytes: int) -> str:
    rng = random.Random(num_bytes)
    words = ["the", "quick", "brown", "fox", "serving", "tokens", "prefill", "decode"]
    out = " ".join(rng.choice(words) for _ in range(num_bytes // 4 + 1))
    return out[:num_bytes]


async def _measure(tokenizer, num_bytes: int, repeats: int, pool: AdmissionPool) -> dict:
    request = generation_pb2.GenerateRequest(text=_text(num_bytes),
                                             sampling=generation_pb2.SamplingParams(max_tokens=8))
    admit = functools.partial(validate_request, request, vocab_size=1 << 20, max_model_len=1 << 22,
                              tokenize=functools.partial(tokenizer.encode, max_tokens=(1 << 22) - 1))
    row = {"bytes": num_bytes}
    for mode in ("inline", "pool"):
        walls, stalls = [], []
        for _ in range(repeats):
            longest, stop = [0.0], asyncio.Event()

            async def ticker() -> None:
                last = time.perf_counter()
                while not stop.is_set():
                    await asyncio.sleep(0)
                    now = time.perf_counter()
                    longest[0], last = max(longest[0], now - last), now

            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            started = time.perf_counter()
            await pool.run(mode == "inline", admit)
            walls.append(time.perf_counter() - started)
            stop.set()
            await tick
            stalls.append(longest[0])
        row[f"{mode}_ms"] = statistics.median(walls) * 1e3
        row[f"{mode}_loop_blocked_ms"] = max(stalls) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=pathlib.Path, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from common.tiny_model import write_tiny_qwen3
        model = write_tiny_qwen3(pathlib.Path(tempfile.mkdtemp()) / "tiny-qwen3")
    tokenizer = load_tokenizer(model)
    pool = AdmissionPool()

    async def run() -> list[dict]:
        return [await _measure(tokenizer, n, max(2, args.repeats if n <= 65536 else 3), pool) for n in SIZES]

    rows = asyncio.run(run())
    pool.close()
    print(f"{'bytes':>8} {'inline ms':>10} {'blocked':>9} {'pool ms':>9} {'blocked':>9}")
    for r in rows:
        print(f"{r['bytes']:>8} {r['inline_ms']:>10.3f} {r['inline_loop_blocked_ms']:>9.3f} "
              f"{r['pool_ms']:>9.3f} {r['pool_loop_blocked_ms']:>9.3f}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
