"""Stages moe_e2e and moe_e2e_fp8: Qwen3-30B-A3B's config with random bf16 weights (load_format
dummy; moe_e2e_fp8 quantizes them to block FP8 at load, experts included) through the in-process
engine (tools.offline.LLM) on nano-vllm's bench.py workload: output tok/s against its floor (the
experts each step's batch touches; bench/floor.py), and FP8 against bf16 (issue 24: >= 1.3x)."""
from __future__ import annotations

import argparse
import sys
import time

from bench.floor import ModelShape, workload_floor
from bench.options import config_dir, load_config, measured_rates

REQUIRES = ("bandwidth",)


def dummy_llm(args: argparse.Namespace, name: str, **options):
    """The in-process engine on a config of bench.options.CONFIGS, with random weights."""
    from tools.offline import LLM

    return LLM(str(config_dir(args, name)), device=args.device, load_format="dummy", **options)


def run(args: argparse.Namespace, quantization: str | None = None) -> dict:
    from bench.workload import nano_vllm_workload
    from common.sampling import SamplingParams

    config = load_config(args, "moe")
    if args.tiny:
        load = nano_vllm_workload(8, 8, 48, 48, max_token_id=config["vocab_size"] - 1)
    else:
        load = nano_vllm_workload(args.num_requests, max_token_id=min(10000, config["vocab_size"] - 1))
    longest = max(len(p) + n for p, n in zip(load.prompts, load.max_tokens))
    started = time.perf_counter()
    llm = dummy_llm(args, "moe", max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=longest + 16,
                    quantization=quantization)
    startup_s = time.perf_counter() - started
    llm.generate([[1, 2, 3]], [SamplingParams(max_tokens=8, ignore_eos=True)])   # warm-up, as bench.py does
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in load.max_tokens]
    started = time.perf_counter()
    outputs = llm.generate(load.prompts, params)
    seconds = time.perf_counter() - started
    return {"output_tokens": sum(len(o) for o in outputs), "seconds": seconds, "startup_s": startup_s,
            "prompts": load.prompt_lens, "max_tokens": load.max_tokens,
            "num_kv_blocks": llm.runner.num_kv_blocks, "block_size": llm.runner.block_size}


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    rates = measured_rates(results)
    model = "tiny Qwen3-MoE" if args.tiny else "Qwen3-30B-A3B"
    bf16 = results.get("moe_e2e", {})
    for stage, weights in (("moe_e2e", "bf16"), ("moe_e2e_fp8", "fp8")):
        if not results.get(stage, {}).get("ok"):
            continue
        e = results[stage]["result"]
        tps = e["output_tokens"] / e["seconds"]
        print(f"\n{model} ({weights} dummy weights), bench.py workload in-process: {tps:.0f} output tok/s "
              f"({e['output_tokens']} tokens in {e['seconds']:.1f} s; startup {e['startup_s']:.0f} s)")
        if rates:
            shape = ModelShape(load_config(args, "moe"), fp8=weights == "fp8")
            f = workload_floor(e["prompts"], e["max_tokens"], shape, rates)
            floor_tps = e["output_tokens"] / f.total_s
            print(f"  floor {floor_tps:.0f} tok/s ({f.total_s:.1f} s: decode {f.decode_s:.1f} + "
                  f"prefill {f.prefill_s:.1f}) -> {tps / floor_tps:.1%} of floor (target >= 50%)")
        if weights == "fp8" and bf16.get("ok"):
            b = bf16["result"]
            print(f"  fp8 / bf16: {tps / (b['output_tokens'] / b['seconds']):.2f}x (target >= 1.3x)")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
