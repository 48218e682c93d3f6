"""Stages decode_<model>_<dtype>: Qwen3-0.6B and Qwen3-8B configs, bf16 and --quantization fp8
(dummy weights), decode tok/s at --fixed-batch through the in-process engine against each one's
floor. The decode time is the span from the prefill's token to the last of --fixed-steps decode
steps' tokens as the engine returned them (with each step's median and 90th-percentile time)."""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from bench.floor import ModelShape, decode_step_floor_s
from bench.options import load_config, measured_rates
from bench.stages.moe_e2e import dummy_llm

REQUIRES = ("bandwidth",)
MODELS = ("0.6b", "8b")
DTYPES = ("bf16", "fp8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fixed-batch", type=int, default=256, help="batch of the decode_<model>_<dtype> and fp8_gemm stages")
    p.add_argument("--fixed-prompt", type=int, default=32,
                   help="prompt tokens of each decode_<model>_<dtype> request (short: the step is about the weights)")
    p.add_argument("--fixed-steps", type=int, default=128, help="decode steps timed in the decode_<model>_<dtype> stages")
    p.add_argument("--fixed-kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8"),
                   help="the KV cache of the decode_<model>_<dtype> stages (fp8: FP8 weights with an FP8 KV cache)")
    p.add_argument("--fixed-lm-head-dtype", default="auto", choices=("auto", "fp8"),
                   help="the LM head of the decode_<model>_fp8 stages (fp8: --lm-head-dtype fp8, quantized at load)")
    p.add_argument("--fixed-profile", action="store_true",
                   help="also the kernels' time a decode step (torch.profiler over two more runs, CUDA only): "
                        "what the step's wall time holds beyond its device work")


def stage_name(model: str, dtype: str) -> str:
    return f"decode_{model}_{dtype}"


def run(args: argparse.Namespace, model: str = "0.6b", dtype: str = "bf16") -> dict:
    from common.sampling import SamplingParams

    config = load_config(args, model)
    batch, prompt_len, steps = (8, 16, 16) if args.tiny else (args.fixed_batch, args.fixed_prompt, args.fixed_steps)
    started = time.perf_counter()
    llm = dummy_llm(args, model, quantization=None if dtype == "bf16" else dtype, max_num_seqs=batch,
                    max_num_batched_tokens=16384, max_model_len=prompt_len + steps + 16,
                    kv_cache_dtype=args.fixed_kv_cache_dtype,
                    lm_head_dtype="auto" if dtype == "bf16" else args.fixed_lm_head_dtype)
    startup_s = time.perf_counter() - started

    def timed_run(seed: int, max_tokens: int) -> float:
        rng = random.Random(seed)
        prompts = [[rng.randrange(config["vocab_size"]) for _ in range(prompt_len)] for _ in range(batch)]
        started = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
        if any(len(o) != max_tokens for o in outputs):
            raise RuntimeError(f"an output is not {max_tokens} tokens long")
        return time.perf_counter() - started

    timed_run(0, 1 + steps)   # compiles every shape the timed runs use
    prefill_s = statistics.median(timed_run(seed, 1) for seed in (1, 2))
    total_s = timed_run(3, 1 + steps)
    # The decode steps' own times: from the prefill's token to the last step's, as generate received
    # them (v38: the call's start-up and prefill, subtracted as two runs' difference, varied by ~0.1 s).
    times = llm.step_times
    if len(times) != steps + 1:
        raise RuntimeError(f"{len(times)} steps returned tokens, expected {steps + 1} (one prefill, {steps} decodes)")
    intervals = [b - a for a, b in zip(times, times[1:])]
    median = statistics.median(intervals)
    decode_s = times[-1] - times[0]
    device_ms = None
    if args.fixed_profile and args.device != "cpu":   # the decode steps' kernels: a long run's less a 1-token run's
        device_ms = (kernel_ms(lambda: timed_run(4, 1 + steps)) - kernel_ms(lambda: timed_run(5, 1))) / steps
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "kv_cache_dtype": args.fixed_kv_cache_dtype,
            "lm_head_dtype": "auto" if dtype == "bf16" else args.fixed_lm_head_dtype,
            "device_ms_per_step": device_ms, "decode_s": decode_s, "decode_s_by_difference": total_s - prefill_s, "prefill_s": prefill_s,
            "step_ms_median": median * 1e3,
            "step_ms_p90": statistics.quantiles(intervals, n=10)[-1] * 1e3,
            "step_ms_mean": decode_s / len(intervals) * 1e3,
            # the steps that took over 1.5x the median (step index, ms): where a mean above the median comes from
            "slow_steps": [(i, round(t * 1e3, 2)) for i, t in enumerate(intervals) if t > 1.5 * median][:16],
            "tok_per_s": batch * steps / decode_s, "startup_s": startup_s}


def kernel_ms(call) -> float:
    """Milliseconds of CUDA kernels (and copies) that call ran, by torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    rates = measured_rates(results)
    print(f"\ndecode at a fixed batch, in-process engine (dummy weights, KV cache {args.fixed_kv_cache_dtype}, "
          f"FP8 models' LM head {args.fixed_lm_head_dtype}); "
          "floor: weights + KV over the copy bandwidth, or the FLOPs at the measured rate")
    print(f"{'model':14s} {'batch':>5s} {'tok/s':>9s} {'floor':>9s} {'of floor':>8s} {'vs bf16':>8s} "
          f"{'step p50':>8s} {'p90 ms':>7s} {'device':>7s}")
    for model in MODELS:
        for dtype in DTYPES:
            record = results.get(stage_name(model, dtype), {})
            if record.get("ok"):
                _print_row(args, model, dtype, record["result"], results.get(stage_name(model, "bf16"), {}), rates)
    print("  (target: Qwen3-8B fp8 >= 1.3x bf16 at batch 256)")


def _print_row(args, model: str, dtype: str, r: dict, bf16: dict, rates: dict | None) -> None:
    floor = f"{'-':>9s} {'-':>8s}"
    if rates:
        shape = ModelShape(load_config(args, model), fp8=dtype == "fp8")
        floor_tps = r["batch"] / decode_step_floor_s(shape, r["batch"], r["batch"] * (r["prompt_len"] + r["steps"] / 2),
                                                     rates)
        floor = f"{floor_tps:9.0f} {r['tok_per_s'] / floor_tps:8.1%}"
    speedup = f"{r['tok_per_s'] / bf16['result']['tok_per_s']:7.2f}x" if dtype != "bf16" and bf16.get("ok") else ""
    label = f"{'tiny ' + model if args.tiny else 'Qwen3-' + model.upper()} {dtype}"
    steps = f"{r['step_ms_median']:8.2f} {r['step_ms_p90']:7.2f}" if "step_ms_median" in r else ""
    if r.get("device_ms_per_step") is not None:
        steps += f" {r['device_ms_per_step']:7.2f}"
    print(f"{label:14s} {r['batch']:5d} {r['tok_per_s']:9.0f} {floor} {speedup:>8s} {steps}")
    if r.get("slow_steps"):
        print(f"  {'':12s} mean step {r['step_ms_mean']:.2f} ms; steps over 1.5x the median (index, ms): "
              + ", ".join(f"{i} {ms}" for i, ms in r["slow_steps"]))


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
