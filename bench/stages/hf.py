"""Stages hf_default and hf_tuned: transformers' own continuous batching (ContinuousBatchingManager)
on the workload, at its defaults and with its CUDA graphs and a 16k-token batch budget.

Requests go through the manager one by one so each keeps its own max_new_tokens (generate_batch
takes one length for all). EOS is disabled (eos_token_id -1) as ignore_eos does elsewhere, and
sampling is plain temperature 1 (top-k and top-p off), as the other engines are asked for.
Keyword arguments that this transformers version does not know are left out rather than failing,
since the GPU machine's transformers is older than ours.
"""
from __future__ import annotations

import argparse
import inspect
import pathlib
import sys
import time

from bench.options import model_dir, workload
from bench.workload import Workload

REQUIRES = ("checkpoint",)


def _supported(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _batching_config(tuned: bool, max_batch_tokens: int):
    """None: transformers' defaults. tuned: its CUDA graphs and a large token budget per step."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    if not tuned:
        return ContinuousBatchingConfig()
    return ContinuousBatchingConfig(**_supported(ContinuousBatchingConfig, {
        "use_cuda_graph": True, "max_batch_tokens": max_batch_tokens}))


def run(args: argparse.Namespace, tuned: bool = False) -> dict:
    """tuned: its CUDA graphs and --max-num-batched-tokens per step; else its defaults."""
    return run_continuous_batching(model_dir(args), workload(args), tuned=tuned,
                                   max_batch_tokens=args.max_num_batched_tokens, device=args.device)


def run_continuous_batching(path: pathlib.Path, load: Workload, *, tuned: bool,
                            max_batch_tokens: int = 16384, device: str = "cuda") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    generation_config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(load.max_tokens),
        eos_token_id=-1, pad_token_id=0)
    batching_config = _batching_config(tuned, max_batch_tokens)
    context_kwargs = _supported(model.continuous_batching_context_manager, {
        "generation_config": generation_config, "continuous_batching_config": batching_config,
        "block": True, "warmup": True})
    started = time.perf_counter()
    with model.continuous_batching_context_manager(**context_kwargs) as manager:
        # One short request first, timed apart, like the other engines' warm-up.
        _collect(manager, [[1, 2, 3]], [8])
        ready = time.perf_counter()
        generated = _collect(manager, load.prompts, load.max_tokens)
        done = time.perf_counter()
    return {"output_tokens": generated, "seconds": done - ready, "setup_s": ready - started,
            "attn_implementation": getattr(model.config, "_attn_implementation", "?"),
            "batching_config": {k: v for k, v in vars(batching_config).items() if isinstance(v, (bool, int, float, str))}}


def _collect(manager, prompts: list[list[int]], max_tokens: list[int]) -> int:
    """Submits every prompt and waits for all of them; returns the tokens generated."""
    request_ids = [manager.add_request(input_ids=p, max_new_tokens=n) for p, n in zip(prompts, max_tokens)]
    pending = set(request_ids)
    generated = 0
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"the manager stopped with {len(pending)} of {len(prompts)} requests unfinished")
            continue
        if result.is_finished() and result.request_id in pending:
            if result.error:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            generated += len(result.generated_tokens)
            pending.discard(result.request_id)
    return generated


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
