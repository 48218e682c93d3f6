"""The GPU benchmark: this service, the same engine in-process, and transformers' continuous
batching, side by side on nano-vllm's workload, against the floor; decode steps, a profile and a
correctness check against transformers; the MoE and FP8 paths; the host path. One GPU, one run.

Every stage (bench/stages/, registered in STAGES) runs in its own subprocess, so each gets the whole
GPU and a failing or hanging stage costs only its own row, and writes OUT/<stage>.json; the tables
are printed from whatever JSON files OUT holds, so stages can also run in separate invocations. A
stage whose inputs OUT lacks (the checkpoint, the measured bandwidth) gets them run first.

    PYTHONUNBUFFERED=1 python -m bench.gpu_bench --out /tmp/bench                      # the headline stages
    python -m bench.gpu_bench --out /tmp/bench --stages service,decode --num-requests 64
    python -m bench.gpu_bench --out /tmp/moe-fp8 --stages moe                          # H200: < 6 minutes
    python -m bench.gpu_bench --out /tmp/moe-cpu --stages moe --device cpu --tiny      # smoke test
    python -m bench.gpu_bench --out /tmp/kernels --stages linear,attention              # H200: < 7 minutes
    python -m bench.stages.decode --out /tmp/bench                                     # one stage alone
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

from bench import options
from bench.stages import (attention, bandwidth, checkpoint, correctness, decode, fixed_batch, fp8_gemm, hf,
                          host_path, linear, moe_e2e, moe_kernel, offline, profile, sampler, service, spec,
                          spec_service, structured)


@dataclass(frozen=True)
class Stage:
    module: ModuleType
    options: dict = field(default_factory=dict)    # keyword arguments of module.run
    entry: Callable[..., dict] | None = None       # run(args, **options) for a module of another convention

    def run(self, args: argparse.Namespace) -> dict:
        return (self.entry or self.module.run)(args, **self.options)


def run_attention(args: argparse.Namespace) -> dict:
    """The attention stage, whose run takes the folder and the device (its tables go to its log)."""
    return attention.run(args.out, device=args.device)


STAGES: dict[str, Stage] = {
    "checkpoint": Stage(checkpoint),
    "bandwidth": Stage(bandwidth),
    "service": Stage(service),
    "structured": Stage(structured),
    "offline": Stage(offline),
    "hf_default": Stage(hf, {"tuned": False}),
    "hf_tuned": Stage(hf, {"tuned": True}),
    "decode": Stage(decode),
    "profile": Stage(profile),
    "correctness": Stage(correctness),
    "moe_kernel": Stage(moe_kernel),
    "fp8_gemm": Stage(fp8_gemm),
    "moe_e2e": Stage(moe_e2e),
    "moe_e2e_fp8": Stage(moe_e2e, {"quantization": "fp8"}),
    **{fixed_batch.stage_name(m, d): Stage(fixed_batch, {"model": m, "dtype": d})
       for m in fixed_batch.MODELS for d in fixed_batch.DTYPES},
    "host_path": Stage(host_path),
    "linear": Stage(linear),
    "attention": Stage(attention, entry=run_attention),
    "sampler": Stage(sampler),
    "spec": Stage(spec),
    "spec_service": Stage(spec_service),
}
GROUPS = {
    "headline": ("checkpoint", "bandwidth", "service", "structured", "offline", "hf_default", "hf_tuned", "decode",
                 "profile", "correctness"),
    "moe": ("bandwidth", "moe_kernel", "fp8_gemm", "moe_e2e", "moe_e2e_fp8", *(n for n in STAGES if n.startswith("decode_"))),
    "kernels": ("linear", "attention"),
    "all": tuple(STAGES),
}
# The side-by-side table: (label, stage) of each engine run on the workload.
ENGINES = (("this service (gRPC, separate processes)", "service"), ("same engine in-process", "offline"),
           ("transformers CB, defaults", "hf_default"), ("transformers CB, CUDA graphs + 16k", "hf_tuned"))


def modules() -> list[ModuleType]:
    """Each registered module once, in registration order."""
    return list(dict.fromkeys(stage.module for stage in STAGES.values()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_arguments(p)
    p.add_argument("--stages", default="headline",
                   help=f"comma-separated stages or groups ({', '.join(GROUPS)}); stages: {', '.join(STAGES)}")
    p.add_argument("--run-stage", choices=list(STAGES), help=argparse.SUPPRESS)  # the subprocess side
    for module in modules():
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
    return p.parse_args(argv)


def selected_stages(spec: str) -> list[str]:
    """The named stages and groups, expanded, each once, in the order given."""
    names = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name not in STAGES and name not in GROUPS:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}; groups {', '.join(GROUPS)}")
        names += GROUPS.get(name, (name,))
    return list(dict.fromkeys(names))


def with_requirements(names: list[str], done: set[str]) -> list[str]:
    """names, each preceded by the stages it reads that are neither done nor already before it."""
    order: list[str] = []
    for name in names:
        for required in getattr(STAGES[name].module, "REQUIRES", ()):
            if required not in done and required not in order:
                order.append(required)
        if name not in order:
            order.append(name)
    return order


# --- one stage, in its own process --------------------------------------------------------------

def run_stage(args: argparse.Namespace) -> int:
    """The subprocess side: runs one stage and records its result or its error."""
    stage = STAGES[args.run_stage]
    # An in-process worker's start-up choices (linear methods per kind, attention backend, graph
    # sizes) go to the stage's log, where a surprising number can be traced to them.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("worker_svc").setLevel(logging.INFO)
    # every candidate's time in the linear selection, not only the winner's and the runner-up's (v38)
    logging.getLogger("worker_svc.layers.linear_selection").setLevel(logging.DEBUG)
    started = time.perf_counter()
    try:
        record = {"ok": True, "result": stage.run(args)}
    except Exception as exc:  # recorded, so the table shows why the row is missing
        traceback.print_exc()
        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    record["wall_s"] = time.perf_counter() - started
    (args.out / f"{args.run_stage}.json").write_text(json.dumps(record, indent=1))
    return 0 if record["ok"] else 1


def launch(args: argparse.Namespace, stage: str, argv: list[str]) -> bool:
    log = args.out / "logs" / f"{stage}.log"
    started = time.perf_counter()
    print(f"== {stage} (log: {log})", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")   # the Triton kernels, interpreted
    with log.open("w") as f:
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.gpu_bench", *argv, "--run-stage", stage],
                                  cwd=options.REPO, stdout=f, stderr=subprocess.STDOUT, timeout=args.stage_timeout,
                                  env=env)
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"killed after {args.stage_timeout:.0f} s"
            (args.out / f"{stage}.json").write_text(json.dumps({"ok": False, "error": status}))
    print(f"   {status} in {time.perf_counter() - started:.0f} s", flush=True)
    if status != "ok":
        print("   " + "\n   ".join(log.read_text().splitlines()[-15:]), flush=True)
    return status == "ok"


# --- the tables -----------------------------------------------------------------------------------

def load_results(args: argparse.Namespace) -> dict[str, dict]:
    return {stage: json.loads((args.out / f"{stage}.json").read_text())
            for stage in STAGES if (args.out / f"{stage}.json").exists()}


def throughput_floor(args: argparse.Namespace, results: dict[str, dict]) -> float | None:
    """Output tok/s of the workload at its floor, with the measured rates; None without them."""
    from bench.floor import ModelShape, workload_floor

    rates = options.measured_rates(results)
    if not rates or not (options.model_dir(args) / "config.json").exists():
        return None
    load = options.workload(args)
    shape = ModelShape.from_file(options.model_dir(args) / "config.json")
    return load.output_tokens / workload_floor(load.prompt_lens, load.max_tokens, shape, rates).total_s


def print_engines(args: argparse.Namespace, results: dict[str, dict]) -> None:
    """The engines side by side on the workload, against its floor."""
    from bench.floor import ModelShape, workload_floor

    ok = {stage: r["result"] for stage, r in results.items() if r.get("ok")}
    load = options.workload(args)
    print(f"\n# workload: {len(load.prompts)} requests, prompts {sum(load.prompt_lens)} tokens, "
          f"outputs {load.output_tokens} tokens (nano-vllm bench.py, seed 0)")
    service_tps = ok["service"]["output_tokens"] / ok["service"]["seconds"] if "service" in ok else None
    floor_tps = throughput_floor(args, results)
    print(f"\n{'engine':38s} {'tok/s':>9s} {'seconds':>8s} {'vs service':>10s} {'of floor':>9s}")
    for label, stage in ENGINES:
        if stage not in ok:
            print(f"{label:38s} {'-':>9s}   {results.get(stage, {}).get('error', 'not run')[:70]}")
            continue
        tps = ok[stage]["output_tokens"] / ok[stage]["seconds"]
        vs = f"{tps / service_tps:10.2f}" if service_tps else f"{'-':>10s}"
        of_floor = f"{tps / floor_tps:9.1%}" if floor_tps else f"{'-':>9s}"
        print(f"{label:38s} {tps:9.0f} {ok[stage]['seconds']:8.2f} {vs} {of_floor}")
    if floor_tps:
        shape = ModelShape.from_file(options.model_dir(args) / "config.json")
        floor = workload_floor(load.prompt_lens, load.max_tokens, shape, options.measured_rates(results))
        print(f"{'floor (analytic, see bench/floor.py)':38s} {floor_tps:9.0f} {floor.total_s:8.2f}    "
              f"decode {floor.decode_s:.2f} s over {floor.decode_steps} steps + prefill {floor.prefill_s:.2f} s")


def print_tables(args: argparse.Namespace) -> None:
    results = load_results(args)
    ok = {stage for stage, r in results.items() if r.get("ok")}
    if "bandwidth" in ok:
        bandwidth.report(args, results)
    if ok & {stage for _, stage in ENGINES}:
        print_engines(args, results)
    for module in modules():
        ran = {name for name, stage in STAGES.items() if stage.module is module} & ok
        if ran and hasattr(module, "report") and module is not bandwidth:
            module.report(args, results)
    for stage, r in results.items():
        if not r.get("ok"):
            print(f"# {stage} failed: {r.get('error', '')[:300]}")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run_stage:
        return run_stage(args)
    (args.out / "logs").mkdir(exist_ok=True)
    try:
        names = selected_stages(args.stages)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    done = {stage for stage, r in load_results(args).items() if r.get("ok")}
    failed = [stage for stage in with_requirements(names, done) if not launch(args, stage, argv)]
    print_tables(args)
    return 1 if failed else 0


def run_alone(module_name: str, argv: list[str]) -> int:
    """`python -m bench.stages.<module> --out DIR [flags]`: that module's stages, as --stages would."""
    names = [name for name, stage in STAGES.items() if stage.module.__name__ == module_name]
    return main(["--stages", ",".join(names), *argv])


if __name__ == "__main__":
    sys.exit(main())
