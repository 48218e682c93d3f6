"""Stage spec_service: speculative decoding through the real processes, as it is deployed: a worker
with random weights on the Qwen3-8B shapes and the scheduler in its own process over loopback gRPC,
per method (none, eagle3, draft at k = 4), batches of greedy requests streamed a token a message.

Random weights reject the drafts, so every step emits one token and a request's time per output
token is the step: a verifying step's whole cost end to end (scheduler, gRPC, worker), where the
in-process spec stage shares one interpreter between them. '@ len 3' predicts a method's speedup at
acceptance length 3 from its step, as the spec stage does; the oracle bound stays that stage's
(its proposer lives in the engine's process)."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

from bench.options import config_dir, load_config
from bench.stages.spec import METHOD_K, REPEATS, Shape, _eagle3_dir, _prompts, predicted_speedup
from tools.launch import free_port, scheduler_proc, worker_proc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-service-methods", default="none,eagle3,draft",
                   help="the spec_service stage's methods (none: the worker without speculation)")


def run(args: argparse.Namespace) -> dict:
    shape = Shape.of(args)
    prompts = _prompts(shape, load_config(args, "8b")["vocab_size"])
    rows = []
    for method in args.spec_service_methods.split(","):
        with _services(args, shape, method) as (addr, metrics_port):
            for b in shape.batches:
                rows.append(_measure(args, shape, addr, metrics_port, method, prompts[b]))
                # As measured, so that a call cut short (a lost machine, a timeout) still shows it.
                print(f"spec_service: {method} batch {b}: {rows[-1]['step_ms']:.2f} ms a step", flush=True)
    baseline = {row["batch"]: row for row in rows if row["proposer"] == "none"}
    for row in rows:
        if row["proposer"] != "none" and row["batch"] in baseline:
            row["at_length_3"] = predicted_speedup(row["step_ms"], baseline[row["batch"]]["step_ms"], 3.0)
    return {"rows": rows, "shape": {"batches": shape.batches, "prompt": shape.prompt, "tokens": shape.tokens}}


def _method_flags(args: argparse.Namespace, method: str) -> list[str]:
    if method == "none":
        return []
    head = _eagle3_dir(args) if method == "eagle3" else config_dir(args, "0.6b")
    return ["--speculative-method", method, "--speculative-model", str(head),
            "--num-speculative-tokens", str(METHOD_K)]


@contextlib.contextmanager
def _services(args: argparse.Namespace, shape: Shape, method: str):
    """(scheduler address, its metrics port) of a worker with `method` and a scheduler on it."""
    logs = args.out / "logs"
    sizes = ["--max-num-seqs", str(shape.max_num_seqs), "--max-num-batched-tokens",
             str(max(4096, max(shape.batches) * 16)), "--max-model-len", str(shape.max_model_len)]
    target = config_dir(args, "8b")
    worker = worker_proc(target, logs, "--device", args.device, "--attention-backend", args.attention_backend,
                         "--load-format", "dummy", "--num-kv-blocks", str(shape.kv_blocks()), *sizes,
                         *_method_flags(args, method)).start()
    try:
        worker.wait_serving(timeout=900)
        metrics_port = free_port()
        scheduler = scheduler_proc(target, logs, [worker.addr], *sizes, "--stream-interval", "1",
                                   "--speculative-max-batch-size", str(max(shape.batches)),
                                   "--metrics-port", str(metrics_port), "--log-level", "WARNING").start()
        try:
            scheduler.wait_serving(timeout=300)
            yield scheduler.addr, metrics_port
        finally:
            scheduler.stop()
    finally:
        worker.stop()


def _measure(args: argparse.Namespace, shape: Shape, addr: str, metrics_port: int, method: str,
             prompts: list[list[int]]) -> dict:
    """The fastest of REPEATS runs of these prompts at once (after one that compiles and warms)."""
    from bench.multiproc_client import send_from_processes
    from tools.loadtest.datasets import Prompt

    def send(max_tokens: int) -> tuple[list[dict], float]:
        requests = [Prompt(max_tokens=max_tokens, token_ids=tuple(p), ignore_eos=True, temperature=0.0)
                    for p in prompts]
        records, seconds, _ = send_from_processes(addr, requests, processes=1)
        failed = [r for r in records if r["status"] != "OK" or r["output_tokens"] != max_tokens]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed or were cut short: {failed[0]}")
        return records, seconds

    send(1 + min(shape.tokens, 16))
    before = _spec_counters(metrics_port)
    runs = [send(shape.tokens) for _ in range(REPEATS)]
    after = _spec_counters(metrics_port)
    records, seconds = min(runs, key=lambda run: run[1])
    verifications, drafts, accepted = (a - b for a, b in zip(after, before))
    tpot_ms = statistics.median(r["tpot_s"] for r in records) * 1e3
    return {"proposer": method, "batch": len(prompts), "step_ms": tpot_ms,
            "tok_per_s": len(prompts) * shape.tokens / seconds,
            "ttft_ms": statistics.median(r["ttft_s"] for r in records) * 1e3,
            "verifications": verifications, "drafts": drafts, "accepted": accepted,
            "acceptance_length": 1 + accepted / verifications if verifications else 1.0}


def _spec_counters(port: int) -> tuple[float, float, float]:
    """The scheduler's verifications, draft tokens and accepted drafts so far (Prometheus)."""
    from tools.loadtest.metrics import scrape_metrics

    values = scrape_metrics(port)
    return tuple(values.get(f"llm_spec_decode_{name}_total", 0.0)
                 for name in ("verifications", "draft_tokens", "accepted_tokens"))


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    result = results["spec_service"]["result"]
    model = "tiny 8b" if args.tiny else "Qwen3-8B"
    print(f"\nspeculative decoding through the service, {model} shapes (dummy weights), greedy, a token a message; "
          f"step = time per output token (drafts rejected: one token a step)")
    print(f"{'proposer':9s} {'batch':>5s} {'step ms':>8s} {'tok/s':>9s} {'TTFT ms':>8s} {'accept len':>10s} "
          f"{'@ len 3':>8s}")
    for row in result["rows"]:
        at3 = f"{row['at_length_3']:7.2f}x" if "at_length_3" in row else f"{'-':>8s}"
        print(f"{row['proposer']:9s} {row['batch']:5d} {row['step_ms']:8.2f} {row['tok_per_s']:9.0f} "
              f"{row['ttft_ms']:8.1f} {row['acceptance_length']:10.2f} {at3}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
