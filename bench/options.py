"""The flags every benchmark stage shares, and what the stages derive from them: the checkpoint's
directory, the workload, the engine's and the worker's flags, the config directories of the
MoE/FP8 stages, and the rates the bandwidth stage measured."""
from __future__ import annotations

import argparse
import json
import pathlib

from bench.workload import Workload, nano_vllm_workload

REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_MESSAGE_BYTES = 64 << 20
CONFIGS = {"moe": "qwen3-30b-a3b.json", "0.6b": "qwen3-0.6b.json", "8b": "qwen3-8b.json"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=pathlib.Path, required=True, help="results (one JSON per stage), logs, checkpoint")
    p.add_argument("--model", type=pathlib.Path, help="use this model directory instead of writing a checkpoint")
    p.add_argument("--config", type=pathlib.Path, default=REPO / "configs" / "qwen3-0.6b.json",
                   help="the checkpoint stage's config")
    p.add_argument("--device", default="cuda", help="cpu works for a smoke test with a tiny --model (or --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny configs and workloads in the MoE/FP8 stages (CPU smoke)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt and longest output")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--frontends", type=int, default=4, help="frontend processes of the service and structured stages")
    p.add_argument("--client-processes", type=int, default=4, help="processes a stage's client spreads its streams over")
    p.add_argument("--stage-timeout", type=float, default=900.0, help="seconds before a stage is killed")


def model_dir(args: argparse.Namespace) -> pathlib.Path:
    return args.model or args.out / "model"


def max_token_id(args: argparse.Namespace) -> int:
    """nano-vllm's prompt ids go up to 10000; a tiny smoke-test model has fewer."""
    vocab = json.loads((model_dir(args) / "config.json").read_text())["vocab_size"]
    return min(10000, vocab - 1)


def workload(args: argparse.Namespace) -> Workload:
    return nano_vllm_workload(args.num_requests, args.min_len, args.max_len, args.max_len,
                              max_token_id=max_token_id(args))


def engine_args(args: argparse.Namespace) -> list[str]:
    return ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len)]


def worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--device", args.device, "--attention-backend", args.attention_backend, *engine_args(args))


def config_dir(args: argparse.Namespace, name: str) -> pathlib.Path:
    """A config of CONFIGS (or its tiny stand-in with --tiny) and the tiny tokenizer, no weights:
    the MoE/FP8 stages load dummy weights. Written once per OUT."""
    out = args.out / "models" / name
    if (out / "config.json").exists():
        return out
    if args.tiny:
        from common.tiny_model import write_tiny_qwen3, write_tiny_qwen3_moe

        if name == "moe":
            write_tiny_qwen3_moe(out, num_experts=16, num_experts_per_tok=4, mlp_only_layers=())
        else:
            write_tiny_qwen3(out, hidden_size=64 if name == "0.6b" else 128, num_layers=2)
    else:
        from bench.model_dirs import write_config_dir

        write_config_dir(out, REPO / "configs" / CONFIGS[name])
    return out


def load_config(args: argparse.Namespace, name: str) -> dict:
    return json.loads((config_dir(args, name) / "config.json").read_text())


def measured_rates(results: dict[str, dict]) -> dict | None:
    """The bandwidth stage's rates (copy bytes/s, bf16 and FP8 FLOP/s), if it ran."""
    record = results.get("bandwidth", {})
    return record.get("result") if record.get("ok") else None
