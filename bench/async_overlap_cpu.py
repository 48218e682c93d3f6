"""Async scheduling on CPU: steps/s of the real processes (a worker and the scheduler over loopback
gRPC, on the tiny model) with the scheduler one step ahead of the worker, and without.

Each run sends every request at once (short prompts, ignore_eos, so the steps are decodes of the
whole batch) and reads the scheduler's Prometheus counters before and after: steps/s, output
tokens/s, and the share of the wall time the worker spent in its forward passes (what pipelining
raises: the worker no longer idles through the round trip and the scheduler's per-step work).
The two modes alternate, so load from other processes on the machine hits both alike.

    python -m bench.async_overlap_cpu [--model DIR] [--num-requests 32] [--max-tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import statistics
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from common.tiny_model import write_tiny_qwen3
from tests.support.client import generate
from tests.support.procs import free_port, running_services
from tools.loadtest.client import LoadClient
from tools.loadtest.datasets import Prompt

MODES = {"sync": ("--no-async-scheduling",), "async": ()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=pathlib.Path, help="model directory (default: a fresh tiny checkpoint)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating")
    return p.parse_args(argv)


def scrape(port: int) -> dict[str, float]:
    """The step count and the summed worker forward time so far."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("llm_step_seconds_count", "llm_worker_forward_seconds_sum"):
                values[sample.name] = sample.value
    return values


async def send_all(addr: str, prompts: list[Prompt]) -> None:
    import grpc

    async with grpc.aio.insecure_channel(addr) as channel:
        records = await LoadClient(channel, timeout_s=None, token=None).send_all_at_once(prompts, "bench")
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].status} {failed[0].error}")


def run(model: pathlib.Path, logs: pathlib.Path, mode: str, prompts: list[Prompt]) -> dict[str, float]:
    metrics_port = free_port()
    with running_services(model, logs, scheduler_args=("--metrics-port", str(metrics_port), *MODES[mode])) as svc:
        with svc.channel() as channel:                   # warm-up
            generate(channel, token_ids=[1, 2, 3], max_tokens=8, ignore_eos=True)
        before = scrape(metrics_port)
        started = time.perf_counter()
        asyncio.run(send_all(svc.scheduler_addr, prompts))
        seconds = time.perf_counter() - started
        after = scrape(metrics_port)
    steps = after["llm_step_seconds_count"] - before["llm_step_seconds_count"]
    forward = after["llm_worker_forward_seconds_sum"] - before["llm_worker_forward_seconds_sum"]
    return {"steps_per_s": steps / seconds, "tokens_per_s": sum(p.max_tokens for p in prompts) / seconds,
            "forward_share": forward / seconds, "steps": steps}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model = args.model or write_tiny_qwen3(tmp / "tiny-qwen3")
        rng = random.Random(0)
        prompts = [Prompt(max_tokens=args.max_tokens, ignore_eos=True,
                          token_ids=tuple(rng.randrange(3, 500) for _ in range(args.prompt_len)))
                   for _ in range(args.num_requests)]
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for i in range(args.repeats):
            for mode in MODES:
                results[mode].append(run(model, tmp / "logs", mode, prompts))
                print(f"run {i + 1} {mode:>5}: " + ", ".join(f"{k} {v:.3g}" for k, v in results[mode][-1].items()),
                      flush=True)
    print(f"\n{args.num_requests} requests x {args.max_tokens} tokens, median of {args.repeats} runs")
    print(f"{'mode':>6} {'steps/s':>9} {'tokens/s':>9} {'worker forward share':>21}")
    for mode, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{mode:>6} {med['steps_per_s']:9.1f} {med['tokens_per_s']:9.0f} {med['forward_share']:21.0%}")


if __name__ == "__main__":
    main()
