"""Model directories for GPU benchmarks, where no machine can download a checkpoint.

- `write_config_dir`: a config (e.g. configs/qwen3-0.6b.json) plus the embedded tiny tokenizer,
  so `--load-format dummy` starts a worker on real shapes with random weights.
- `write_random_checkpoint`: the same plus seeded random weights saved by transformers, so the
  service, the in-process engine and transformers itself all run identical weights (needed to
  compare their outputs, and fair for speed).
The tiny tokenizer covers 512 ids; larger ids decode to nothing, which the benchmarks (token-id
prompts, ignore_eos) never notice.

    python -m bench.model_dirs --config configs/qwen3-0.6b.json --out /tmp/qwen3-0.6b-dummy [--weights]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "qwen3-0.6b.json"


def write_config_dir(out: pathlib.Path, config_path: pathlib.Path = DEFAULT_CONFIG) -> pathlib.Path:
    """config.json, generation_config.json and the tiny tokenizer in `out`; no weights."""
    from common.tiny_model import save_tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(config_path.read_text())
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}) + "\n")
    save_tiny_tokenizer(out)
    return out


def write_random_checkpoint(out: pathlib.Path, config_path: pathlib.Path = DEFAULT_CONFIG, *, seed: int = 0,
                            device: str = "cuda") -> pathlib.Path:
    """write_config_dir plus model.safetensors: transformers' own initialisation, seeded, in the
    config's dtype (initialised on `device`, which is much faster than the CPU for 0.6B)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    write_config_dir(out, config_path)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json; keep the benchmark's own.
    (out / "config.json").write_text(config_path.read_text())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=pathlib.Path, default=DEFAULT_CONFIG)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--weights", action="store_true", help="also write seeded random weights (needs torch)")
    parser.add_argument("--device", default="cuda", help="where to initialise the weights")
    args = parser.parse_args()
    if args.weights:
        write_random_checkpoint(args.out, args.config, device=args.device)
    else:
        write_config_dir(args.out, args.config)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
