"""Stage structured: the service's workload three times, each on a fresh scheduler (an empty prefix
cache): no constraints, --json-schema-ratio of the requests (seeded) under a JSON schema
(tools/loadtest/datasets.py's bounded records: the grammar stays open for the whole output), no
constraints again (the two unconstrained runs bound the noise); with the first constrained request's
extra latency over a warm unconstrained one (xgrammar's start and the grammar's compile on the
worker) and the TPOT of constrained vs free requests. The written checkpoint carries the tiny
tokenizer: masks span the full vocabulary, but compile and fill times are a real Qwen3
tokenizer's only with --model."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.stages.service import running_scheduler, running_worker, send_all, workload_prompts

REQUIRES = ("checkpoint",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-schema-ratio", type=float, default=0.1,
                   help="share of the structured stage's requests constrained by a JSON schema")


def run(args: argparse.Namespace) -> dict:
    import numpy as np

    from tools.loadtest.datasets import DEFAULT_JSON_SCHEMA, with_json_schema

    plain = workload_prompts(args)
    mixed = with_json_schema(np.random.default_rng(0), plain, args.json_schema_ratio, DEFAULT_JSON_SCHEMA)
    constrained_ids = {i for i, p in enumerate(mixed) if p.json_schema is not None}
    runs, first_compile_s = [], None
    with running_worker(args) as worker:
        for name, prompts in (("none", plain), ("json", mixed), ("none again", plain)):
            with running_scheduler(args, worker) as scheduler:
                if name == "json":
                    first_compile_s = _first_constrained_extra_s(scheduler, DEFAULT_JSON_SCHEMA)
                records, seconds = send_all(args, scheduler, prompts)
            constrained = [r for r in records if name == "json" and _index(r, args) in constrained_ids]
            free = [r for r in records if not (name == "json" and _index(r, args) in constrained_ids)]
            runs.append({"name": name, "output_tokens": sum(r["output_tokens"] for r in records), "seconds": seconds,
                         "constrained_requests": len(constrained), "tpot_median_free_s": _tpot(free),
                         "tpot_median_constrained_s": _tpot(constrained)})
    return {"runs": runs, "json_schema_ratio": args.json_schema_ratio, "first_constrained_extra_s": first_compile_s}


def _first_constrained_extra_s(scheduler, schema: str) -> float:
    from common.client import Client

    with Client(scheduler.addr, timeout=600) as client:
        started = time.perf_counter()
        client.generate([1, 2, 3], max_tokens=8, ignore_eos=True)
        plain_s = time.perf_counter() - started
        started = time.perf_counter()
        client.generate([1, 2, 3], max_tokens=8, ignore_eos=True, json_schema=schema)
        return time.perf_counter() - started - plain_s


def _index(record: dict, args: argparse.Namespace) -> int:
    """Request ids are "bench{process}-{j}": prompt j * processes + process."""
    process, j = record["request_id"].removeprefix("bench").split("-")
    return int(j) * args.client_processes + int(process)


def _tpot(records: list[dict]) -> float | None:
    values = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    return statistics.median(values) if values else None


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    st = results["structured"]["result"]
    none = [r for r in st["runs"] if r["name"].startswith("none")]
    base = statistics.mean(r["output_tokens"] / r["seconds"] for r in none)
    print(f"\nstructured output: {st['json_schema_ratio']:.0%} of the requests under a JSON schema vs none "
          f"(fresh scheduler per run); first constrained request +{(st['first_constrained_extra_s'] or 0):.2f} s "
          "(xgrammar start and compile on the worker)")
    print(f"  {'run':12s} {'tok/s':>9s} {'seconds':>8s} {'vs none':>8s} {'TPOT free':>10s} {'TPOT json':>10s}")
    for r in st["runs"]:
        tps = r["output_tokens"] / r["seconds"]
        constrained = r["tpot_median_constrained_s"]
        json_tpot = f"{constrained * 1e3:8.2f}ms" if constrained else f"{'-':>10s}"
        print(f"  {r['name']:12s} {tps:9.0f} {r['seconds']:8.2f} {tps / base:8.3f} "
              f"{(r['tpot_median_free_s'] or 0) * 1e3:8.2f}ms {json_tpot}")
    if len(none) == 2:
        a, b = (r["output_tokens"] / r["seconds"] for r in none)
        print(f"  noise: the two unconstrained runs differ by {abs(a - b) / base:.1%}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
