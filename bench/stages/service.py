"""Stage service: a worker and the scheduler (engine core + --frontends processes) over loopback
gRPC, all requests at once through the public Generate API from --client-processes processes, once
per --stream-intervals value, with every process's CPU sampled and every step in the engine core's
step log (scheduler_svc/engine/step_log.py: where the run's time went, by step kind and batch);
then greedy outputs of the correctness prompts, which the correctness stage compares with
transformers."""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import sys
import time

from bench.options import engine_args, model_dir, worker_args, workload
from bench.stages.correctness import CORRECTNESS_TOKENS, correctness_prompts
from tools.launch import Proc, scheduler_proc, worker_proc
from worker_svc.late_compiles import MARK

REQUIRES = ("checkpoint",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-intervals", default="1,8", help="the service stage runs once per stream interval")


@contextlib.contextmanager
def running_worker(args: argparse.Namespace):
    worker = worker_proc(model_dir(args), args.out / "logs", *worker_args(args)).start()
    try:
        yield worker.wait_serving(timeout=900)
    finally:
        worker.stop()


@contextlib.contextmanager
def running_scheduler(args: argparse.Namespace, worker: Proc, *extra: str):
    """A fresh scheduler (an empty prefix cache) on the worker, warmed up as nano-vllm's bench does."""
    from common.client import Client

    scheduler = scheduler_proc(model_dir(args), args.out / "logs", [worker.addr], *engine_args(args),
                               "--frontends", str(args.frontends), "--log-level", "WARNING", *extra).start()
    try:
        scheduler.wait_serving(timeout=300)
        with Client(scheduler.addr, timeout=600) as client:
            client.generate([1, 2, 3], max_tokens=8, ignore_eos=True)
        yield scheduler
    finally:
        scheduler.stop()


def send_all(args: argparse.Namespace, scheduler: Proc, prompts, on_start=None) -> tuple[list[dict], float]:
    """Every prompt at once from --client-processes processes; the records and the wall time.
    Raises when a request failed or returned other than its max_tokens."""
    from bench.multiproc_client import send_from_processes

    records, seconds, _ = send_from_processes(scheduler.addr, prompts, processes=args.client_processes,
                                              on_start=on_start)
    failed = [r for r in records if r["status"] != "OK"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]['status']} {failed[0]['error']}")
    if sorted(r["output_tokens"] for r in records) != sorted(p.max_tokens for p in prompts):
        raise RuntimeError("some requests returned a wrong number of tokens")
    return records, seconds


def workload_prompts(args: argparse.Namespace):
    from tools.loadtest.datasets import Prompt

    load = workload(args)
    return [Prompt(max_tokens=n, token_ids=tuple(p), ignore_eos=True) for p, n in zip(load.prompts, load.max_tokens)]


def run(args: argparse.Namespace) -> dict:
    """The worker stays up; the scheduler is started afresh for each stream interval."""
    prompts = workload_prompts(args)
    variants, greedy = [], None
    with running_worker(args) as worker:
        for interval in (int(i) for i in args.stream_intervals.split(",")):
            steps = args.out / "logs" / f"steps-interval{interval}.tsv"
            steps.unlink(missing_ok=True)
            with running_scheduler(args, worker, "--stream-interval", str(interval), "--step-log", str(steps)) \
                    as scheduler:
                variants.append(_one_variant(args, worker, scheduler, prompts, interval))
                if greedy is None:
                    greedy = _greedy(scheduler, args)
            # Complete once the engine core has shut down; only the workload's steps count.
            start_s, end_s = variants[-1].pop("window")
            variants[-1]["step_log"] = dict(path=str(steps), start_s=start_s, end_s=end_s)
            variants[-1]["steps"] = _steps(variants[-1]["step_log"])
    return dict(variants[0], variants=variants, greedy=greedy)


def _steps(where: dict, floor_ms=None) -> dict | None:
    """The step log's summary over the variant's window (scheduler_svc/engine/step_log.py)."""
    from scheduler_svc.engine import step_log

    try:
        return step_log.summarize(where["path"], where["start_s"], where["end_s"], floor_ms)
    except (OSError, ValueError, KeyError) as exc:   # a scheduler without --step-log (an older tree), or cut short
        print(f"no step log summary ({exc!r})", file=sys.stderr)
        return None


def step_floor_ms(args: argparse.Namespace, results: dict[str, dict]):
    """floor_ms(seqs, sampled, tokens, kv_tokens) of one step, from the model's shape and the bandwidth
    stage's rates (None without them): a decode step's as bench/floor.py has it; a step with prefill
    chunks reads the same bytes, or computes 2 FLOPs per linear weight and scheduled token (the LM
    head's for its sampled rows), whichever takes longer (its attention FLOPs left out)."""
    from bench.floor import ModelShape, decode_step_floor_s
    from bench.options import measured_rates

    rates, config = measured_rates(results), model_dir(args) / "config.json"
    if not rates or not config.exists():
        return None
    shape = ModelShape.from_file(config)

    def floor_ms(seqs: int, sampled: int, tokens: int, kv_tokens: int) -> float:
        if tokens == seqs:
            return decode_step_floor_s(shape, seqs, kv_tokens, rates) * 1e3
        memory = (shape.step_bytes(tokens) + kv_tokens * shape.kv_bytes_per_token) / rates["copy_bytes_per_s"]
        linear_flops, head_flops = shape.step_flops(tokens)[0], shape.step_flops(sampled)[1]
        return max(memory, (linear_flops + head_flops) / rates["bf16_flops_per_s"]) * 1e3
    return floor_ms


def _one_variant(args, worker: Proc, scheduler: Proc, prompts, interval: int) -> dict:
    from bench.proc_cpu import CpuSampler

    samplers = []

    def watch(client_pids):
        named = {"scheduler": scheduler.popen.pid, "worker": worker.popen.pid}
        named.update({f"client{i}": pid for i, pid in enumerate(client_pids)})
        samplers.append(CpuSampler(named).__enter__())

    log_start = worker.log.stat().st_size if worker.log.exists() else 0
    started = time.perf_counter()
    records, seconds = send_all(args, scheduler, prompts, on_start=watch)
    ended = time.perf_counter()
    samplers[0].__exit__(None, None, None)
    tpots = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    return {"frontends": args.frontends, "stream_interval": interval,
            "output_tokens": sum(r["output_tokens"] for r in records), "seconds": seconds,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in records),
            "tpot_median_s": statistics.median(tpots) if tpots else None, "cpu": samplers[0].summary(),
            "late_compiles": late_compiles_in(worker.log, log_start), "window": (started, ended)}


def late_compiles_in(log: pathlib.Path, start: int = 0) -> int:
    """Kernels the worker compiled while serving (worker_svc/late_compiles.py's WARNINGs) in its log
    from byte `start` on: each one stalled a step for up to a second."""
    try:
        with log.open("rb") as f:
            f.seek(start)
            return f.read().count(MARK.encode())
    except OSError:
        return 0


def _greedy(scheduler: Proc, args: argparse.Namespace) -> list[list[int]]:
    from common.client import Client

    with Client(scheduler.addr, timeout=600) as client:
        return [client.generate(p, max_tokens=CORRECTNESS_TOKENS, ignore_eos=True, temperature=0.0).token_ids
                for p in correctness_prompts(args)]


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    from bench.gpu_bench import throughput_floor

    floor_tps = throughput_floor(args, results)
    print(f"\nservice variants (--frontends, --stream-interval), client over {args.client_processes} processes; "
          "CPU: median cores of each process (scheduler = engine core; its children are the frontends)")
    service = results["service"]["result"]
    floor_ms = step_floor_ms(args, results)
    for v in service.get("variants", [service]):
        tps = v["output_tokens"] / v["seconds"]
        of_floor = f"{tps / floor_tps:6.1%}" if floor_tps else "-"
        print(f"  frontends {v.get('frontends', '?')}, stream interval {v.get('stream_interval', 1)}: "
              f"{tps:8.0f} tok/s ({of_floor} of floor), TTFT median {v['ttft_median_s'] * 1e3:.0f} ms, "
              f"TPOT median {(v['tpot_median_s'] or 0) * 1e3:.2f} ms"
              + (f", {v['late_compiles']} kernels compiled mid-run (see the worker's log)" if v.get("late_compiles") else ""))
        cpu = v.get("cpu", {})
        if cpu:
            print("    cpu: " + ", ".join(f"{name} {c['median']:.2f} (max {c['max']:.2f})" for name, c in cpu.items()))
        steps = v.get("steps")
        if v.get("step_log") and floor_ms and pathlib.Path(v["step_log"]["path"]).exists():
            steps = _steps(v["step_log"], floor_ms) or steps
        if steps:
            from scheduler_svc.engine import step_log

            print("\n".join("    " + line for line in step_log.report_lines(steps)))


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
