"""Fills a model's parameters from Hugging Face safetensors, or with seeded random values.

Checkpoint names map onto the model's: q/k/v_proj go into qkv_proj and gate/up_proj into
gate_up_proj (packed_modules_mapping); each parameter's weight_loader takes this rank's shard.
Loading checks that every part of every parameter was filled, so a truncated or mismatched
checkpoint fails at start-up instead of generating garbage.
"""
from __future__ import annotations

import json
import logging
import pathlib

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

# Buffers some older checkpoints saved as weights; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's weight files: the shards named by model.safetensors.index.json, or
    every *.safetensors in the directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    return sorted(model_dir.glob("*.safetensors"))


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    param.data.copy_(loaded)


def _expected_parts(model: nn.Module) -> set[tuple[str, object]]:
    """(parameter name, shard id) of every part the checkpoint must fill; a parameter shared by
    two modules (tied embeddings) counts once, under its first name."""
    parts, seen = set(), set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(prefix=module_name, recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                parts.update((param_name, shard) for shard in getattr(module, "shard_ids", (None,)))
    return parts


def _target(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for checkpoint_part, (packed_part, shard_id) in packed.items():
        if f".{checkpoint_part}." in name:
            return name.replace(f".{checkpoint_part}.", f".{packed_part}."), shard_id
    return name, None


def load_safetensors(model: nn.Module, model_dir: pathlib.Path) -> None:
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (use --load-format dummy for random weights)")
    params = dict(model.named_parameters())   # a tied lm_head is the embedding: listed once
    tied = getattr(model.config, "tie_word_embeddings", False)
    packed = getattr(model, "packed_modules_mapping", {})
    filled: set[tuple[str, object]] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target, shard_id = _target(name, packed)
                if target not in params:
                    raise ValueError(f"{file.name}: weight {name!r} has no place in {type(model).__name__}")
                param = params[target]
                getattr(param, "weight_loader", _default_loader)(param, f.get_tensor(name), shard_id)
                filled.add((target, shard_id))
    missing = _expected_parts(model) - filled
    if missing:
        listed = ", ".join(sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)[:8])
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} weights, e.g. {listed}")
    logger.info("loaded %d tensors from %d safetensors file(s) in %s", len(filled), len(files), model_dir)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights for benchmarks: only the shapes matter. Norm scales are 1 and biases 0 so
    activations stay finite; the same seed gives the same weights on the same device."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
