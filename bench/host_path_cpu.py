"""The host path without a GPU: the real scheduler (engine core + frontends) and a real worker
process whose forward is a wait of the floor's length (bench/sleep_worker.py), driven by many client
streams from several processes. It prints, per configuration, the decode step time over the wait
(1.00 would be a host path that costs nothing on the critical path), tokens per second, and every
process's CPU use.

    python -m bench.host_path_cpu --out /tmp/host [--frontends 0,2,4] [--stream-intervals 1,8]

Defaults: 256 requests of 1024 prompt tokens and 128 output tokens, a 7.36 ms forward (Qwen3-0.6B's
batch-256, context-1024 floor on an H200). Steady-state decode steps (every request running, one
token each) are the ones timed.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--forward-ms", type=float, default=7.36)
    p.add_argument("--frontends", default="0,2", help="comma-separated frontend counts to compare")
    p.add_argument("--stream-intervals", default="1", help="comma-separated stream intervals to compare")
    p.add_argument("--client-processes", type=int, default=4)
    return p.parse_args(argv)


def run_one(args, model_dir: pathlib.Path, frontends: int, stream_interval: int) -> dict:
    from bench.multiproc_client import send_from_processes
    from bench.proc_cpu import CpuSampler
    from tests.support.procs import Proc, free_port, scheduler_proc
    from tools.loadtest.datasets import Prompt

    tag = f"f{frontends}-s{stream_interval}"
    logs = args.out / f"logs-{tag}"
    logs.mkdir(parents=True, exist_ok=True)
    trace = args.out / f"trace-{tag}.txt"
    context = args.prompt_len + args.max_tokens
    blocks = args.num_requests * -(-context // 16) + 64
    engine = ["--max-num-seqs", str(args.num_requests), "--max-num-batched-tokens", "16384",
              "--max-model-len", str(context + 16)]
    port = free_port()
    worker = Proc(f"worker-{port}", f"127.0.0.1:{port}",
                  ["bench.sleep_worker", "--forward-ms", str(args.forward_ms), "--trace", str(trace),
                   "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                   "--num-kv-blocks", str(blocks), *engine], logs / "worker.log")
    scheduler = scheduler_proc(model_dir, logs, [worker.addr], *engine, "--frontends", str(frontends),
                               "--stream-interval", str(stream_interval), "--log-level", "WARNING")
    rng = random.Random(0)
    prompts = [Prompt(max_tokens=args.max_tokens, ignore_eos=True,
                      token_ids=tuple(rng.randrange(3, 500) for _ in range(args.prompt_len)))
               for _ in range(args.num_requests)]
    worker.start()
    try:
        worker.wait_serving(timeout=120)
        scheduler.start().wait_serving(timeout=120)
        sampler = None

        def watch(client_pids):
            nonlocal sampler
            named = {"scheduler": scheduler.popen.pid, "worker": worker.popen.pid}
            named.update({f"client{i}": pid for i, pid in enumerate(client_pids)})
            sampler = CpuSampler(named).__enter__()

        records, seconds, _ = send_from_processes(scheduler.addr, prompts, processes=args.client_processes,
                                                  on_start=watch)
        sampler.__exit__(None, None, None)
    finally:
        scheduler.stop()
        worker.stop()
    failed = [r for r in records if r["status"] != "OK"]
    steps = [line.split() for line in trace.read_text().splitlines()]
    # Steady decode: consecutive pure-decode steps (one token a request) of the largest batch seen
    # (all requests, unless the clients could not get them in fast enough); the time between ends.
    pure = [(float(t), int(n)) for t, n, k in steps if int(n) == int(k)]
    batch = max((n for _, n in pure), default=0)
    gaps = [b[0] - a[0] for a, b in zip(pure, pure[1:]) if a[1] == b[1] == batch]
    step_ms = statistics.median(gaps) * 1e3 if gaps else float("nan")
    tokens = sum(r["output_tokens"] for r in records)
    return {"frontends": frontends, "stream_interval": stream_interval, "failed": len(failed), "batch": batch,
            "decode_steps_timed": len(gaps), "step_ms": step_ms, "ratio": step_ms / args.forward_ms,
            "output_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "cpu": sampler.summary() if sampler else {}}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from common.tiny_model import write_tiny_qwen3

    model_dir = args.out / "tiny-qwen3"
    if not (model_dir / "config.json").exists():
        write_tiny_qwen3(model_dir)
    rows = []
    for frontends in (int(f) for f in args.frontends.split(",")):
        for interval in (int(s) for s in args.stream_intervals.split(",")):
            started = time.perf_counter()
            row = run_one(args, model_dir, frontends, interval)
            row["wall_s"] = time.perf_counter() - started
            rows.append(row)
            (args.out / "host_path.json").write_text(json.dumps(rows, indent=1))
    print(f"\nhost path, {args.num_requests} streams x {args.max_tokens} tokens, prompt {args.prompt_len}, "
          f"forward replaced by {args.forward_ms} ms:")
    print(f"{'frontends':>9} {'interval':>8} {'batch':>5} {'step ms':>8} {'ratio':>6} {'tok/s':>8} {'failed':>6}  "
          "cpu (median cores)")
    for r in rows:
        cpu = ", ".join(f"{name}={v['median']:.2f}" for name, v in r["cpu"].items())
        print(f"{r['frontends']:>9} {r['stream_interval']:>8} {r['batch']:>5} {r['step_ms']:>8.2f} {r['ratio']:>6.2f} "
              f"{r['tok_per_s']:>8.0f} {r['failed']:>6}  {cpu}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
