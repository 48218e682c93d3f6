"""What naming the tokens of logprobs costs the gateway on a cold cache: one Detokenize call per
token id (as the gateway's TokenTexts did) against one Detokenize(each_token) call for all of them.

`python -m bench.token_texts_cost [--model DIR] [--ids 64,512] [--repeats 5]` starts a worker and
a scheduler (the tiny seeded checkpoint unless --model), then for each count of distinct token
ids times both ways through the asyncio client (median of --repeats) and prints them side by side
with their ratio. A chat answer of 64 tokens with top_logprobs=5 names up to 384 distinct ids.
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.client import AsyncClient  # noqa: E402
from common.tiny_model import write_tiny_qwen3  # noqa: E402
from tests.support.procs import running_services  # noqa: E402


async def _time(client: AsyncClient, ids: list[int], repeats: int) -> tuple[float, float, bool]:
    """Median seconds of one call per id (concurrently) and of one each_token call; whether they agree."""
    per_id, batched = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        one_by_one = await asyncio.gather(*(client.detokenize([i]) for i in ids))
        per_id.append(time.perf_counter() - start)
        start = time.perf_counter()
        together = await client.token_texts(ids)
        batched.append(time.perf_counter() - start)
    return statistics.median(per_id), statistics.median(batched), list(one_by_one) == together


async def _run(addr: str, counts: list[int], repeats: int) -> list[tuple[int, float, float, bool]]:
    async with AsyncClient(addr, timeout=120) as client:
        vocab = (await client.model_info()).vocab_size
        rows = []
        for count in counts:
            ids = [(i * 7919) % vocab for i in range(min(count, vocab))]
            rows.append((len(ids), *await _time(client, ids, repeats)))
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=pathlib.Path, help="model directory (unset: the tiny seeded checkpoint)")
    ap.add_argument("--ids", default="16,64,384", help="counts of distinct token ids, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    counts = [int(c) for c in args.ids.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny_qwen3(pathlib.Path(tmp) / "model")
        with running_services(model, pathlib.Path(tmp) / "logs") as svc:
            rows = asyncio.run(_run(svc.scheduler_addr, counts, args.repeats))
    print(f"{'ids':>6} {'one call per id ms':>19} {'one each_token call ms':>23} {'ratio':>7}  same texts")
    for count, per_id, batched, same in rows:
        print(f"{count:>6} {per_id * 1e3:>19.1f} {batched * 1e3:>23.2f} {per_id / batched:>6.0f}x  {same}")


if __name__ == "__main__":
    main()
