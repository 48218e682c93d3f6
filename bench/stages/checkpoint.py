"""Stage checkpoint: Qwen3-0.6B shapes (--config) with seeded random weights, so every engine runs
identical weights; skipped with --model."""
from __future__ import annotations

import argparse
import sys

from bench.model_dirs import write_random_checkpoint
from bench.options import model_dir


def run(args: argparse.Namespace) -> dict:
    if args.model:
        return {"model": str(args.model), "written": False}
    write_random_checkpoint(model_dir(args), args.config, device=args.device)
    return {"model": str(model_dir(args)), "written": True}


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
