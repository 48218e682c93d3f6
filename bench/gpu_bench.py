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
  service      worker and scheduler processes over loopback gRPC, all requests at once through
               the public Generate API; then greedy prompts for the correctness stage
  offline      the same engine in one process, no gRPC (scheduler_svc.offline.LLM)
  hf_default   transformers ContinuousBatchingManager at its defaults
  hf_tuned     the same with its CUDA graphs and a 16k-token batch budget
  decode       decode steps at batch 1, 64, 256 and fixed context, time split into scheduler,
               transport, input preparation and forward (bench/decode_breakdown.py)
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
STAGES = ("checkpoint", "bandwidth", "service", "offline", "hf_default", "hf_tuned", "decode", "correctness")
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
    p.add_argument("--decode-batches", default="1,64,256")
    p.add_argument("--decode-context", type=int, default=1024)
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


async def _send_all(addr: str, prompts) -> tuple[list, float]:
    import grpc

    from tools.loadtest.client import LoadClient

    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(addr, options=options) as channel:
        client = LoadClient(channel, timeout_s=None, token=None)
        started = time.perf_counter()
        records = await client.send_all_at_once(prompts, "bench")
        return records, time.perf_counter() - started


def correctness_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randint(0, max_token_id(args)) for _ in range(rng.randint(16, 64))]
            for _ in range(CORRECTNESS_PROMPTS)]


def stage_service(args: argparse.Namespace) -> dict:
    import statistics

    from tests.client import generate
    from tests.procs import running_services
    from tools.loadtest.datasets import Prompt

    load = workload(args)
    prompts = [Prompt(max_tokens=n, token_ids=tuple(p), ignore_eos=True) for p, n in zip(load.prompts, load.max_tokens)]
    with running_services(model_dir(args), args.out / "logs", worker_args=worker_args(args),
                          scheduler_args=tuple(engine_args(args))) as services:
        with services.channel() as channel:  # warm-up, as nano-vllm's bench does
            generate(channel, token_ids=[1, 2, 3], max_tokens=8, ignore_eos=True)
        records, seconds = asyncio.run(_send_all(services.scheduler_addr, prompts))
        failed = [r for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].status} {failed[0].error}")
        short = [r for r, n in zip(records, load.max_tokens) if r.output_tokens != n]
        if short:
            raise RuntimeError(f"{len(short)} requests returned a wrong number of tokens")
        with services.channel() as channel:
            greedy = [generate(channel, token_ids=p, max_tokens=CORRECTNESS_TOKENS, ignore_eos=True,
                               temperature=0.0).token_ids for p in correctness_prompts(args)]
    output_tokens = sum(r.output_tokens for r in records)
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    return {"output_tokens": output_tokens, "seconds": seconds,
            "ttft_median_s": statistics.median(r.ttft_s for r in records),
            "tpot_median_s": statistics.median(tpots) if tpots else None, "greedy": greedy}


def stage_offline(args: argparse.Namespace) -> dict:
    from tools.offline import LLM
    from scheduler_svc.sampling_params import SamplingParams

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


def stage_decode(args: argparse.Namespace) -> dict:
    from bench.decode_breakdown import measure_decode_breakdown
    from tests.procs import worker_proc

    batches = [int(b) for b in args.decode_batches.split(",")]
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    worker = worker_proc(model_dir(args), log_dir, *worker_args(args)).start()
    try:
        worker.wait_serving(timeout=600)
        rows = measure_decode_breakdown(worker.addr, model_dir(args), batch_sizes=batches, context=args.decode_context,
                                        max_num_batched_tokens=args.max_num_batched_tokens,
                                        max_token_id=max_token_id(args))
    finally:
        worker.stop()
    # The worker inherits this environment; WORKER_FUSED_KERNELS=0 times the unfused torch path.
    return {"rows": rows, "fused_kernels": os.environ.get("WORKER_FUSED_KERNELS", "1") != "0"}


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
    "checkpoint": stage_checkpoint, "bandwidth": stage_bandwidth, "service": stage_service, "offline": stage_offline,
    "hf_default": lambda a: stage_hf(a, tuned=False), "hf_tuned": lambda a: stage_hf(a, tuned=True),
    "decode": stage_decode, "correctness": stage_correctness,
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
    rows = [("this service (gRPC, 2 processes)", "service"), ("same engine in-process", "offline"),
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
    if "service" in ok and ok["service"].get("tpot_median_s"):
        s = ok["service"]
        print(f"# service: median TTFT {s['ttft_median_s'] * 1e3:.0f} ms, median TPOT {s['tpot_median_s'] * 1e3:.2f} ms")
    if "decode" in ok:
        fused = "on" if ok["decode"].get("fused_kernels", True) else "off"
        print(f"\ndecode steps at context {args.decode_context} (medians, ms; fused kernels {fused})")
        print(f"{'batch':>5s} {'step':>7s} {'sched':>7s} {'transp':>7s} {'prep':>7s} {'forward':>8s} {'w.rest':>7s} "
              f"{'floor':>7s} {'tok/s':>8s}")
        for row in ok["decode"]["rows"]:
            floor_ms = (decode_step_floor_s(shape, row["batch"], row["context"], bandwidth["copy_bytes_per_s"]) * 1e3
                        if bandwidth else float("nan"))
            if "step_ms" not in row:
                print(f"{row['batch']:5d}   no pure-decode steps measured")
                continue
            print(f"{row['batch']:5d} {row['step_ms']:7.2f} {row['scheduler_ms']:7.2f} {row['transport_ms']:7.2f} "
                  f"{row['prepare_ms']:7.2f} {row['forward_ms']:8.2f} {row['worker_rest_ms']:7.2f} {floor_ms:7.3f} "
                  f"{row['batch'] / row['step_ms'] * 1e3:8.0f}")
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
