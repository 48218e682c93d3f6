"""Stage offline: the same engine in one process, no gRPC (tools.offline.LLM), on the workload."""
from __future__ import annotations

import argparse
import sys
import time

from bench.options import model_dir, workload

REQUIRES = ("checkpoint",)


def run(args: argparse.Namespace) -> dict:
    from common.sampling import SamplingParams
    from tools.offline import LLM

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


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
