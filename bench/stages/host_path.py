"""Stage host_path: the host path without a GPU. The real scheduler (engine core + frontends) and a
real worker process whose forward is a wait of the floor's length (bench/sleep_worker.py), driven by
many client streams from --client-processes processes; per configuration (--host-path-frontends x
--host-path-stream-intervals), the decode step time over the wait (1.00 would be a host path that
costs nothing on the critical path), tokens per second, and every process's CPU use.

Defaults: 256 requests of 1024 prompt tokens and 128 output tokens, a 7.36 ms forward (Qwen3-0.6B's
batch-256, context-1024 floor on an H200). Steady-state decode steps (every request running, one
token each) are the ones timed.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

from tools.launch import Proc, free_port, scheduler_proc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-path-requests", type=int, default=256)
    p.add_argument("--host-path-prompt-len", type=int, default=1024)
    p.add_argument("--host-path-max-tokens", type=int, default=128)
    p.add_argument("--forward-ms", type=float, default=7.36, help="the host_path stage's forward, a wait")
    p.add_argument("--host-path-frontends", default="0,2", help="comma-separated frontend counts to compare")
    p.add_argument("--host-path-stream-intervals", default="1", help="comma-separated stream intervals to compare")
    p.add_argument("--host-path-eager-prepare", action="store_true",
                   help="the worker prepares decode steps as a CPU worker does, not staged for decode graphs as a GPU's")


def run(args: argparse.Namespace) -> dict:
    from common.tiny_model import write_tiny_qwen3

    model_dir = args.out / "tiny-qwen3"
    if not (model_dir / "config.json").exists():
        write_tiny_qwen3(model_dir)
    rows = []
    for frontends in (int(f) for f in args.host_path_frontends.split(",")):
        for interval in (int(s) for s in args.host_path_stream_intervals.split(",")):
            started = time.perf_counter()
            row = _run_one(args, model_dir, frontends, interval)
            row["wall_s"] = time.perf_counter() - started
            rows.append(row)
    failed = sum(r["failed"] for r in rows)
    if failed:
        raise RuntimeError(f"{failed} requests failed: {rows}")
    return {"rows": rows}


def _run_one(args: argparse.Namespace, model_dir: pathlib.Path, frontends: int, stream_interval: int) -> dict:
    from tools.loadtest.datasets import Prompt

    tag = f"f{frontends}-s{stream_interval}"
    logs = args.out / f"logs-{tag}"
    trace = args.out / f"trace-{tag}.txt"
    context = args.host_path_prompt_len + args.host_path_max_tokens
    blocks = args.host_path_requests * -(-context // 16) + 64
    engine = ["--max-num-seqs", str(args.host_path_requests), "--max-num-batched-tokens", "16384",
              "--max-model-len", str(context + 16)]
    port = free_port()
    worker = Proc(f"worker-{port}", f"127.0.0.1:{port}",
                  ["bench.sleep_worker", "--forward-ms", str(args.forward_ms), "--trace", str(trace),
                   *(["--eager-host-path"] if args.host_path_eager_prepare else []),
                   "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                   "--num-kv-blocks", str(blocks), *engine], logs / "worker.log")
    scheduler = scheduler_proc(model_dir, logs, [worker.addr], *engine, "--frontends", str(frontends),
                               "--stream-interval", str(stream_interval), "--log-level", "WARNING")
    rng = random.Random(0)
    prompts = [Prompt(max_tokens=args.host_path_max_tokens, ignore_eos=True,
                      token_ids=tuple(rng.randrange(3, 500) for _ in range(args.host_path_prompt_len)))
               for _ in range(args.host_path_requests)]
    worker.start()
    try:
        worker.wait_serving(timeout=120)
        scheduler.start().wait_serving(timeout=120)
        records, seconds, cpu = _send(args, scheduler, worker, prompts)
    finally:
        scheduler.stop()
        worker.stop()
    step_ms, batch, gaps = _steady_decode_step_ms(trace)
    tokens = sum(r["output_tokens"] for r in records)
    return {"frontends": frontends, "stream_interval": stream_interval,
            "failed": sum(r["status"] != "OK" for r in records), "batch": batch, "decode_steps_timed": gaps,
            "step_ms": step_ms, "ratio": step_ms / args.forward_ms, "output_tokens": tokens, "seconds": seconds,
            "tok_per_s": tokens / seconds, "cpu": cpu}


def _send(args: argparse.Namespace, scheduler: Proc, worker: Proc, prompts) -> tuple[list[dict], float, dict]:
    from bench.multiproc_client import send_from_processes
    from bench.proc_cpu import CpuSampler

    samplers = []

    def watch(client_pids):
        named = {"scheduler": scheduler.popen.pid, "worker": worker.popen.pid}
        named.update({f"client{i}": pid for i, pid in enumerate(client_pids)})
        samplers.append(CpuSampler(named).__enter__())

    records, seconds, _ = send_from_processes(scheduler.addr, prompts, processes=args.client_processes,
                                              on_start=watch)
    samplers[0].__exit__(None, None, None)
    return records, seconds, samplers[0].summary()


def _steady_decode_step_ms(trace: pathlib.Path) -> tuple[float, int, int]:
    """Consecutive pure-decode steps (one token a request) of the largest batch seen (all requests,
    unless the clients could not get them in fast enough): the median time between their ends."""
    steps = [line.split() for line in trace.read_text().splitlines()]
    pure = [(float(t), int(n)) for t, n, k in steps if int(n) == int(k)]
    batch = max((n for _, n in pure), default=0)
    gaps = [b[0] - a[0] for a, b in zip(pure, pure[1:]) if a[1] == b[1] == batch]
    return (statistics.median(gaps) * 1e3 if gaps else float("nan")), batch, len(gaps)


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    print(f"\nhost path, {args.host_path_requests} streams x {args.host_path_max_tokens} tokens, prompt "
          f"{args.host_path_prompt_len}, forward replaced by {args.forward_ms} ms:")
    print(f"{'frontends':>9} {'interval':>8} {'batch':>5} {'step ms':>8} {'ratio':>6} {'tok/s':>8} {'failed':>6}  "
          "cpu (median cores)")
    for r in results["host_path"]["result"]["rows"]:
        cpu = ", ".join(f"{name}={v['median']:.2f}" for name, v in r["cpu"].items())
        print(f"{r['frontends']:>9} {r['stream_interval']:>8} {r['batch']:>5} {r['step_ms']:>8.2f} "
              f"{r['ratio']:>6.2f} {r['tok_per_s']:>8.0f} {r['failed']:>6}  {cpu}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
