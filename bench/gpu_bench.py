"""The GPU benchmark: this service, the same engine in-process, and transformers' continuous
batching, side by side on nano-vllm's workload, against the floor; plus a decode-heavy breakdown
and a correctness check against transformers. One GPU, one run.

Every stage runs in its own subprocess (so each gets the whole GPU, and a failing or hanging
stage costs only its own row) and writes OUT/<stage>.json; the final tables are printed from
whatever JSON files OUT holds, so stages can also be run in separate invocations.

Stages, in order:
  checkpoint   Qwen3-0.6B shapes (configs/qwen3-0.6b.json) with seeded random weights, so every
               engine runs identical weights (skipped with --model)
  bandwidth    device copy bandwidth (read + write) and bf16 matmul rate, for the floor
  service      a worker and the scheduler (engine core + --frontends processes) over loopback gRPC,
               all requests at once through the public Generate API from --client-processes
               processes, once per --stream-intervals value, with every process's CPU sampled;
               then greedy prompts for the correctness stage
  structured   the service's workload three times, each on a fresh scheduler (an empty prefix
               cache): no constraints, --json-schema-ratio of the requests (seeded) under a JSON
               schema (tools/loadtest/datasets.py's bounded records: the grammar stays open for the
               whole output), no constraints again (the two unconstrained runs bound the noise);
               with the first constrained request's extra latency (xgrammar's start and the
               grammar's compile on the worker) and the TPOT of constrained vs free requests.
               The written checkpoint carries the tiny 504-token tokenizer: masks span the full
               vocabulary, but compile and fill times are a real Qwen3 tokenizer's only with --model
  offline      the same engine in one process, no gRPC (tools.offline.LLM)
  hf_default   transformers ContinuousBatchingManager at its defaults
  hf_tuned     the same with its CUDA graphs and a 16k-token batch budget
  decode       pipelined decode steps (two in flight, as the service runs them) at each
               BATCHxCONTEXT of --decode-cases: step time, device time and host costs
               (bench/decode_breakdown.py)
  profile      torch.profiler over decode graph replays at --profile-batches: the top kernels
               (bench/profile_decode.py)
  correctness  greedy tokens of the service vs transformers bf16 (first 32 tokens), and the
               engine's logits vs transformers fp32 and bf16 on the same prompts

    PYTHONUNBUFFERED=1 python -m bench.gpu_bench --out /tmp/bench [--stages service,decode] [--num-requests 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import subprocess
import sys
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parent.parent
STAGES = ("checkpoint", "bandwidth", "service", "structured", "offline", "hf_default", "hf_tuned", "decode",
          "profile", "correctness")
MAX_MESSAGE_BYTES = 64 << 20
CORRECTNESS_PROMPTS = 4
CORRECTNESS_TOKENS = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="results (one JSON per stage), logs, checkpoint")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {','.join(STAGES)}")
    p.add_argument("--model", type=pathlib.Path, help="use this model directory instead of writing a checkpoint")
    p.add_argument("--config", type=pathlib.Path, default=REPO / "configs" / "qwen3-0.6b.json")
    p.add_argument("--device", default="cuda", help="cpu works for a smoke test with a tiny --model")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt and longest output")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--frontends", type=int, default=4, help="frontend processes of the service stage")
    p.add_argument("--stream-intervals", default="1,8", help="the service stage runs once per stream interval")
    p.add_argument("--client-processes", type=int, default=4, help="processes the service stage's client spreads over")
    p.add_argument("--json-schema-ratio", type=float, default=0.1,
                   help="share of the structured stage's requests constrained by a JSON schema")
    p.add_argument("--decode-cases", default="1x1024,64x1024,256x1024,512x1024,256x4096",
                   help="BATCHxCONTEXT decode cases of the decode stage")
    p.add_argument("--decode-context", type=int, default=1024, help="context of the profile stage")
    p.add_argument("--profile-batches", default="1,64,256")
    p.add_argument("--stage-timeout", type=float, default=900.0, help="seconds before a stage is killed")
    p.add_argument("--run-stage", choices=STAGES, help=argparse.SUPPRESS)  # the subprocess side
    return p.parse_args(argv)


def model_dir(args: argparse.Namespace) -> pathlib.Path:
    return args.model or args.out / "model"


def max_token_id(args: argparse.Namespace) -> int:
    """nano-vllm's prompt ids go up to 10000; a tiny smoke-test model has fewer."""
    vocab = json.loads((model_dir(args) / "config.json").read_text())["vocab_size"]
    return min(10000, vocab - 1)


def workload(args: argparse.Namespace):
    from bench.workload import nano_vllm_workload

    return nano_vllm_workload(args.num_requests, args.min_len, args.max_len, args.max_len,
                              max_token_id=max_token_id(args))


def engine_args(args: argparse.Namespace) -> list[str]:
    return ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len)]


def worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--device", args.device, "--attention-backend", args.attention_backend, *engine_args(args))


# --- stages (each runs in its own process and returns its JSON result) -------------------------

def stage_checkpoint(args: argparse.Namespace) -> dict:
    from bench.model_dirs import write_random_checkpoint

    if args.model:
        return {"model": str(args.model), "written": False}
    write_random_checkpoint(model_dir(args), args.config, device=args.device)
    return {"model": str(model_dir(args)), "written": True}


def stage_bandwidth(args: argparse.Namespace) -> dict:
    import torch
    import triton.testing

    from bench.attention_microbench import measure_copy_bandwidth

    copy_bytes_per_s = measure_copy_bandwidth()
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=500, return_mode="median")
    return {"copy_bytes_per_s": copy_bytes_per_s, "matmul_flops_per_s": 2 * n**3 / (mm_ms * 1e-3),
            "device": torch.cuda.get_device_name()}


def correctness_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randint(0, max_token_id(args)) for _ in range(rng.randint(16, 64))]
            for _ in range(CORRECTNESS_PROMPTS)]


def service_variants(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(frontend processes, stream interval) pairs, from --frontends and --stream-intervals."""
    return [(args.frontends, int(i)) for i in args.stream_intervals.split(",")]


def stage_service(args: argparse.Namespace) -> dict:
    """The workload through the public API, from --client-processes processes, once per service
    variant (the worker stays up; the scheduler is started afresh for each). Every process's CPU
    use is sampled once a second."""
    import statistics

    from bench.multiproc_client import send_from_processes
    from bench.proc_cpu import CpuSampler
    from tests.support.client import generate
    from tests.support.procs import scheduler_proc, worker_proc
    from tools.loadtest.datasets import Prompt

    load = workload(args)
    prompts = [Prompt(max_tokens=n, token_ids=tuple(p), ignore_eos=True) for p, n in zip(load.prompts, load.max_tokens)]
    logs = args.out / "logs"
    worker = worker_proc(model_dir(args), logs, *worker_args(args)).start()
    variants, greedy = [], None
    try:
        worker.wait_serving(timeout=900)
        for frontends, interval in service_variants(args):
            scheduler = scheduler_proc(model_dir(args), logs, [worker.addr], *engine_args(args),
                                       "--frontends", str(frontends), "--stream-interval", str(interval),
                                       "--log-level", "WARNING").start()
            try:
                scheduler.wait_serving(timeout=300)
                with scheduler_channel(scheduler) as channel:  # warm-up, as nano-vllm's bench does
                    generate(channel, token_ids=[1, 2, 3], max_tokens=8, ignore_eos=True)
                samplers = []

                def watch(client_pids, scheduler=scheduler):
                    named = {"scheduler": scheduler.popen.pid, "worker": worker.popen.pid}
                    named.update({f"client{i}": pid for i, pid in enumerate(client_pids)})
                    samplers.append(CpuSampler(named).__enter__())

                records, seconds, _ = send_from_processes(scheduler.addr, prompts, processes=args.client_processes,
                                                          on_start=watch)
                samplers[0].__exit__(None, None, None)
                failed = [r for r in records if r["status"] != "OK"]
                if failed:
                    raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]['status']} {failed[0]['error']}")
                if sorted(r["output_tokens"] for r in records) != sorted(load.max_tokens):
                    raise RuntimeError("some requests returned a wrong number of tokens")
                tpots = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
                variants.append({"frontends": frontends, "stream_interval": interval,
                                 "output_tokens": sum(r["output_tokens"] for r in records), "seconds": seconds,
                                 "ttft_median_s": statistics.median(r["ttft_s"] for r in records),
                                 "tpot_median_s": statistics.median(tpots) if tpots else None,
                                 "cpu": samplers[0].summary()})
                if greedy is None:
                    with scheduler_channel(scheduler) as channel:
                        greedy = [generate(channel, token_ids=p, max_tokens=CORRECTNESS_TOKENS, ignore_eos=True,
                                           temperature=0.0).token_ids for p in correctness_prompts(args)]
            finally:
                scheduler.stop()
    finally:
        worker.stop()
    return dict(variants[0], variants=variants, greedy=greedy)


def stage_structured(args: argparse.Namespace) -> dict:
    """Throughput with a share of JSON-schema requests against none, on one worker; each run gets
    a fresh scheduler (so no run finds the previous one's prompts in the prefix cache)."""
    import statistics

    import numpy as np

    from bench.multiproc_client import send_from_processes
    from tests.support.client import generate
    from tests.support.procs import scheduler_proc, worker_proc
    from tools.loadtest.datasets import DEFAULT_JSON_SCHEMA, Prompt, with_json_schema

    load = workload(args)
    plain = [Prompt(max_tokens=n, token_ids=tuple(p), ignore_eos=True) for p, n in zip(load.prompts, load.max_tokens)]
    mixed = with_json_schema(np.random.default_rng(0), plain, args.json_schema_ratio, DEFAULT_JSON_SCHEMA)
    constrained_ids = {i for i, p in enumerate(mixed) if p.json_schema is not None}
    logs = args.out / "logs"
    worker = worker_proc(model_dir(args), logs, *worker_args(args)).start()
    runs, first_compile_s = [], None
    try:
        worker.wait_serving(timeout=900)
        for name, prompts in (("none", plain), ("json", mixed), ("none again", plain)):
            scheduler = scheduler_proc(model_dir(args), logs, [worker.addr], *engine_args(args),
                                       "--frontends", str(args.frontends), "--log-level", "WARNING").start()
            try:
                scheduler.wait_serving(timeout=300)
                with scheduler_channel(scheduler) as channel:   # warm-up; the first grammar is compiled here
                    started = time.perf_counter()
                    generate(channel, token_ids=[1, 2, 3], max_tokens=8, ignore_eos=True)
                    plain_s = time.perf_counter() - started
                    if name == "json":
                        started = time.perf_counter()
                        generate(channel, token_ids=[1, 2, 3], max_tokens=8, ignore_eos=True,
                                 json_schema=DEFAULT_JSON_SCHEMA)
                        first_compile_s = time.perf_counter() - started - plain_s
                records, seconds, _ = send_from_processes(scheduler.addr, prompts, processes=args.client_processes)
            finally:
                scheduler.stop()
            failed = [r for r in records if r["status"] != "OK"]
            if failed:
                raise RuntimeError(f"{name}: {len(failed)} requests failed, first: {failed[0]['status']} "
                                   f"{failed[0]['error']}")
            if sorted(r["output_tokens"] for r in records) != sorted(load.max_tokens):
                raise RuntimeError(f"{name}: some requests returned a wrong number of tokens")

            def index(record) -> int:   # "bench{process}-{j}": prompt j * processes + process
                process, j = record["request_id"].removeprefix("bench").split("-")
                return int(j) * args.client_processes + int(process)

            def tpot(selected) -> float | None:
                values = [r["tpot_s"] for r in selected if r["tpot_s"] is not None]
                return statistics.median(values) if values else None

            constrained = [r for r in records if name == "json" and index(r) in constrained_ids]
            free = [r for r in records if not (name == "json" and index(r) in constrained_ids)]
            runs.append({"name": name, "output_tokens": sum(r["output_tokens"] for r in records), "seconds": seconds,
                         "constrained_requests": len(constrained), "tpot_median_free_s": tpot(free),
                         "tpot_median_constrained_s": tpot(constrained)})
    finally:
        worker.stop()
    return {"runs": runs, "json_schema_ratio": args.json_schema_ratio, "first_constrained_extra_s": first_compile_s}


def scheduler_channel(proc):
    import grpc

    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    return grpc.insecure_channel(proc.addr, options=options)


def stage_offline(args: argparse.Namespace) -> dict:
    from tools.offline import LLM
    from common.sampling import SamplingParams

    load = workload(args)
    llm = LLM(str(model_dir(args)), device=args.device, attention_backend=args.attention_backend,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len)
    llm.generate([[1, 2, 3]], [SamplingParams(max_tokens=8, ignore_eos=True)])  # warm-up
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in load.max_tokens]
    started = time.perf_counter()
    outputs = llm.generate(load.prompts, params)
    seconds = time.perf_counter() - started
    return {"output_tokens": sum(len(o) for o in outputs), "seconds": seconds}


def stage_hf(args: argparse.Namespace, tuned: bool) -> dict:
    from bench.hf_continuous_batching import run_hf_continuous_batching

    return run_hf_continuous_batching(model_dir(args), workload(args), tuned=tuned,
                                      max_batch_tokens=args.max_num_batched_tokens, device=args.device)


def decode_cases(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in case.split("x")) for case in args.decode_cases.split(",")]


def stage_decode(args: argparse.Namespace) -> dict:
    from bench.decode_breakdown import measure_decode_breakdown
    from tests.support.procs import worker_proc

    cases = decode_cases(args)
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    largest = max(b for b, _ in cases)
    longest = max(c for _, c in cases) + 128
    worker = worker_proc(model_dir(args), log_dir, "--device", args.device, "--attention-backend",
                         args.attention_backend, "--max-num-seqs", str(largest), "--max-num-batched-tokens",
                         str(args.max_num_batched_tokens), "--max-model-len", str(longest)).start()
    try:
        worker.wait_serving(timeout=900)
        rows = measure_decode_breakdown(worker.addr, model_dir(args), cases=cases,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        max_token_id=max_token_id(args))
    finally:
        worker.stop()
    # The worker inherits this environment; WORKER_FUSED_KERNELS=0 times the unfused torch path.
    return {"rows": rows, "fused_kernels": os.environ.get("WORKER_FUSED_KERNELS", "1") != "0"}


def stage_profile(args: argparse.Namespace) -> dict:
    from bench.profile_decode import profile_decode

    return {"rows": profile_decode(model_dir(args), batches=[int(b) for b in args.profile_batches.split(",")],
                                   context=args.decode_context, attention_backend=args.attention_backend)}


def stage_correctness(args: argparse.Namespace) -> dict:
    import torch

    from bench.engine_logits import engine_logits
    from transformers import AutoModelForCausalLM

    prompts = correctness_prompts(args)
    service_file = args.out / "service.json"
    service = json.loads(service_file.read_text()).get("result", {}) if service_file.exists() else {}
    result: dict = {}
    references = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(model_dir(args), dtype=dtype).to(args.device).eval()
        with torch.inference_mode():
            references[dtype] = [model(torch.tensor([p], device=args.device)).logits[0].float() for p in prompts]
            if dtype is torch.bfloat16 and service.get("greedy"):
                hf_greedy = []
                for p in prompts:
                    ids = torch.tensor([p], device=args.device)
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=CORRECTNESS_TOKENS, min_new_tokens=CORRECTNESS_TOKENS,
                                         pad_token_id=0)
                    hf_greedy.append(out[0, len(p):].tolist())
                result.update(greedy_match(service["greedy"], hf_greedy))
        del model
        torch.cuda.empty_cache()
    ours = engine_logits(model_dir(args), prompts, device=args.device, attention_backend=args.attention_backend)
    fp32, bf16 = references[torch.float32], references[torch.bfloat16]
    result["engine_vs_hf_fp32"] = logits_agreement(ours, fp32)
    result["hf_bf16_vs_hf_fp32"] = logits_agreement(bf16, fp32)
    result["engine_vs_hf_bf16"] = logits_agreement(ours, bf16)
    return result


def greedy_match(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Positional match rate, and how many leading tokens agree before the first difference."""
    positions = sum(len(r) for r in reference)
    same = sum(a == b for o, r in zip(ours, reference) for a, b in zip(o, r))
    leading = []
    for o, r in zip(ours, reference):
        n = 0
        while n < min(len(o), len(r)) and o[n] == r[n]:
            n += 1
        leading.append(n)
    return {"greedy_match_rate": same / positions, "greedy_leading_matches": leading}


def logits_agreement(ours: list, reference: list) -> dict:
    import torch

    a, b = torch.cat(ours).double(), torch.cat(reference).double()
    return {"relative_error": ((a - b).norm() / b.norm()).item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).double().mean().item()}


STAGE_FUNCTIONS = {
    "checkpoint": stage_checkpoint, "bandwidth": stage_bandwidth, "service": stage_service,
    "structured": stage_structured, "offline": stage_offline,
    "hf_default": lambda a: stage_hf(a, tuned=False), "hf_tuned": lambda a: stage_hf(a, tuned=True),
    "decode": stage_decode, "profile": stage_profile, "correctness": stage_correctness,
}


def run_stage(args: argparse.Namespace) -> int:
    """The subprocess side: runs one stage and records its result or its error."""
    started = time.perf_counter()
    try:
        record = {"ok": True, "result": STAGE_FUNCTIONS[args.run_stage](args)}
    except Exception as exc:  # recorded, so the table shows why the row is missing
        traceback.print_exc()
        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    record["wall_s"] = time.perf_counter() - started
    (args.out / f"{args.run_stage}.json").write_text(json.dumps(record, indent=1))
    return 0 if record["ok"] else 1


# --- orchestration and the tables ---------------------------------------------------------------

def launch(args: argparse.Namespace, stage: str, argv: list[str]) -> None:
    log = args.out / "logs" / f"{stage}.log"
    started = time.perf_counter()
    print(f"== {stage} (log: {log})", flush=True)
    with log.open("w") as f:
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.gpu_bench", *argv, "--run-stage", stage], cwd=REPO,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=args.stage_timeout,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"killed after {args.stage_timeout:.0f} s"
            (args.out / f"{stage}.json").write_text(json.dumps({"ok": False, "error": status}))
    print(f"   {status} in {time.perf_counter() - started:.0f} s", flush=True)
    if status != "ok":
        print("   " + "\n   ".join(log.read_text().splitlines()[-15:]), flush=True)


def load_results(out: pathlib.Path) -> dict[str, dict]:
    return {stage: json.loads((out / f"{stage}.json").read_text()) for stage in STAGES if (out / f"{stage}.json").exists()}


def print_tables(args: argparse.Namespace) -> None:
    from bench.workload import ModelShape, decode_step_floor_s, workload_floor

    results = load_results(args.out)
    ok = {stage: r["result"] for stage, r in results.items() if r.get("ok")}
    shape = ModelShape.from_config(model_dir(args) / "config.json")
    load = workload(args)
    bandwidth = ok.get("bandwidth")
    print(f"\n# workload: {len(load.prompts)} requests, prompts {sum(map(len, load.prompts))} tokens, "
          f"outputs {load.output_tokens} tokens (nano-vllm bench.py, seed 0)")
    if bandwidth:
        print(f"# {bandwidth['device']}: copy {bandwidth['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), "
              f"bf16 matmul {bandwidth['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    rows = [("this service (gRPC, separate processes)", "service"), ("same engine in-process", "offline"),
            ("transformers CB, defaults", "hf_default"), ("transformers CB, CUDA graphs + 16k", "hf_tuned")]
    service_tps = ok["service"]["output_tokens"] / ok["service"]["seconds"] if "service" in ok else None
    floor_tps = None
    if bandwidth:
        floor = workload_floor(load, shape, bandwidth["copy_bytes_per_s"], bandwidth["matmul_flops_per_s"])
        floor_tps = load.output_tokens / floor.total_s
    print(f"\n{'engine':38s} {'tok/s':>9s} {'seconds':>8s} {'vs service':>10s} {'of floor':>9s}")
    for label, stage in rows:
        if stage not in ok:
            reason = results.get(stage, {}).get("error", "not run")
            print(f"{label:38s} {'-':>9s}   {reason[:70]}")
            continue
        r = ok[stage]
        tps = r["output_tokens"] / r["seconds"]
        vs = f"{tps / service_tps:10.2f}" if service_tps else f"{'-':>10s}"
        of_floor = f"{tps / floor_tps:9.1%}" if floor_tps else f"{'-':>9s}"
        print(f"{label:38s} {tps:9.0f} {r['seconds']:8.2f} {vs} {of_floor}")
    if floor_tps:
        print(f"{'floor (analytic, see bench/workload.py)':38s} {floor_tps:9.0f} {floor.total_s:8.2f}    "
              f"decode {floor.decode_s:.2f} s over {floor.decode_steps} steps + prefill {floor.prefill_s:.2f} s")
    if "service" in ok:
        print(f"\nservice variants (--frontends, --stream-interval), client over {args.client_processes} processes; "
              "CPU: median cores of each process (scheduler = engine core; its children are the frontends)")
        for v in ok["service"].get("variants", [ok["service"]]):
            tps = v["output_tokens"] / v["seconds"]
            of_floor = f"{tps / floor_tps:6.1%}" if floor_tps else "-"
            print(f"  frontends {v.get('frontends', '?')}, stream interval {v.get('stream_interval', 1)}: "
                  f"{tps:8.0f} tok/s ({of_floor} of floor), TTFT median {v['ttft_median_s'] * 1e3:.0f} ms, "
                  f"TPOT median {(v['tpot_median_s'] or 0) * 1e3:.2f} ms")
            cpu = v.get("cpu", {})
            if cpu:
                print("    cpu: " + ", ".join(f"{name} {c['median']:.2f} (max {c['max']:.2f})" for name, c in cpu.items()))
    if "structured" in ok:
        st = ok["structured"]
        none = [r for r in st["runs"] if r["name"].startswith("none")]
        base = statistics_mean([r["output_tokens"] / r["seconds"] for r in none])
        print(f"\nstructured output: {st['json_schema_ratio']:.0%} of the requests under a JSON schema vs none "
              f"(fresh scheduler per run); first constrained request +{(st['first_constrained_extra_s'] or 0):.2f} s "
              "(xgrammar start and compile on the worker)")
        print(f"  {'run':12s} {'tok/s':>9s} {'seconds':>8s} {'vs none':>8s} {'TPOT free':>10s} {'TPOT json':>10s}")
        for r in st["runs"]:
            tps = r["output_tokens"] / r["seconds"]
            json_tpot = f"{r['tpot_median_constrained_s'] * 1e3:8.2f}ms" if r["tpot_median_constrained_s"] else f"{'-':>10s}"
            print(f"  {r['name']:12s} {tps:9.0f} {r['seconds']:8.2f} {tps / base:8.3f} "
                  f"{(r['tpot_median_free_s'] or 0) * 1e3:8.2f}ms {json_tpot}")
        if len(none) == 2:
            spread = abs(none[0]["output_tokens"] / none[0]["seconds"] - none[1]["output_tokens"] / none[1]["seconds"])
            print(f"  noise: the two unconstrained runs differ by {spread / base:.1%}")
    if "decode" in ok:
        fused = "on" if ok["decode"].get("fused_kernels", True) else "off"
        print(f"\npipelined decode steps (two in flight; medians, ms; fused kernels {fused})")
        print(f"{'batch':>5s} {'ctx':>5s} {'step':>7s} {'device':>7s} {'floor':>7s} {'step/dev':>8s} {'dev/floor':>9s} "
              f"{'step/floor':>10s} {'sched':>6s} {'prep':>6s} {'launch':>6s} {'tok/s':>8s}")
        for row in ok["decode"]["rows"]:
            floor_ms = (decode_step_floor_s(shape, row["batch"], row["context"], bandwidth["copy_bytes_per_s"]) * 1e3
                        if bandwidth else float("nan"))
            if "step_ms" not in row:
                print(f"{row['batch']:5d} {row['context']:5d}   {row.get('skipped', 'no pure-decode steps measured')}")
                continue
            device = row["device_ms"] or float("nan")    # 0: no device timing (a CPU run)
            print(f"{row['batch']:5d} {row['context']:5d} {row['step_ms']:7.2f} {device:7.2f} {floor_ms:7.3f} "
                  f"{row['step_ms'] / device:8.2f} {device / floor_ms:9.2f} "
                  f"{row['step_ms'] / floor_ms:10.2f} {row['scheduler_ms']:6.2f} {row['prepare_ms']:6.2f} "
                  f"{row['launch_ms']:6.2f} {row['batch'] / row['step_ms'] * 1e3:8.0f}")
    if "profile" in ok:
        for row in ok["profile"]["rows"]:
            print(f"\nprofile: decode graph replay at batch {row['batch']}, context {row['context']}: "
                  f"{row['device_ms_per_step']:.2f} ms of kernels per step; top kernels (ms per step, share)")
            for name, ms in row["top"][:12]:
                print(f"  {ms:7.3f} {ms / row['device_ms_per_step']:6.1%}  {name[:90]}")
    if "correctness" in ok:
        c = ok["correctness"]
        print("\ncorrectness (bf16 engine vs transformers on the same random weights)")
        if "greedy_match_rate" in c:
            print(f"  greedy, first {CORRECTNESS_TOKENS} tokens vs transformers bf16: match rate "
                  f"{c['greedy_match_rate']:.1%}, leading matches {c['greedy_leading_matches']}")
        for key in ("engine_vs_hf_fp32", "hf_bf16_vs_hf_fp32", "engine_vs_hf_bf16"):
            print(f"  logits {key:20s} relative error {c[key]['relative_error']:.2e}, "
                  f"top-1 agreement {c[key]['top1_agreement']:.1%}")
    for stage, r in results.items():
        if not r.get("ok"):
            print(f"# {stage} failed: {r.get('error', '')[:300]}")


def statistics_mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run_stage:
        return run_stage(args)
    (args.out / "logs").mkdir(exist_ok=True)
    argv = list(argv if argv is not None else sys.argv[1:])
    for stage in [s.strip() for s in args.stages.split(",") if s.strip()]:
        if stage not in STAGES:
            print(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}", file=sys.stderr)
            return 2
        launch(args, stage, argv)
    print_tables(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
