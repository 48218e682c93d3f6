"""Fills a model's parameters from Hugging Face safetensors, or with seeded random values.

Checkpoint names map onto the model's: q/k/v_proj go into qkv_proj and gate/up_proj into
gate_up_proj (packed_modules_mapping); a MoE layer's per-expert projections
`mlp.experts.{i}.{gate,up,down}_proj` go into its stacked expert tensors
(expert_modules_mapping); each parameter's weight_loader takes this rank's shard. An FP8
weight reaches its layer together with its `weight_scale_inv` (worker_svc.layers.fp8), from
whichever file of a sharded checkpoint holds the scale. Loading checks that every part of
every parameter was filled, so a truncated or mismatched checkpoint fails at start-up instead
of generating garbage.
"""
from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import re

import torch
from safetensors import safe_open
from torch import nn

from worker_svc.kv_cache_scales import is_attention_scale
from worker_svc.layers.fp8 import FP8_DTYPE, BlockFp8Tensor

logger = logging.getLogger(__name__)

# Buffers some older checkpoints saved as weights; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SCALE_SUFFIX = "_scale_inv"    # "x.weight" is scaled by "x.weight_scale_inv"
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


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


def expected_parts(model: nn.Module) -> set[tuple[str, object]]:
    """(parameter name, shard id) of every part the checkpoint must fill; a parameter shared by
    two modules (tied embeddings) counts once, under its first name. A parameter's own
    `shard_ids` wins over its module's; `()` means it has no tensor of its own (an FP8 scale,
    filled with its weight)."""
    parts, seen = set(), set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(prefix=module_name, recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                shard_ids = getattr(param, "shard_ids", getattr(module, "shard_ids", (None,)))
                parts.update((param_name, shard) for shard in shard_ids)
    return parts


def _target(name: str, model: nn.Module) -> tuple[str, object]:
    """(model parameter, shard id) that checkpoint tensor `name` fills."""
    experts = getattr(model, "expert_modules_mapping", None)
    if experts and (match := _EXPERT.match(name)) and match["proj"] in experts:
        param, part = experts[match["proj"]]
        return f"{match['prefix']}.{param}", (int(match["expert"]), part)
    for checkpoint_part, (packed_part, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{checkpoint_part}." in name:
            return name.replace(f".{checkpoint_part}.", f".{packed_part}."), shard_id
    return name, None


class _Checkpoint:
    """Every tensor of a (possibly sharded) checkpoint by name, files opened once."""

    def __init__(self, files: list[pathlib.Path], stack: contextlib.ExitStack) -> None:
        self.file_of: dict[str, pathlib.Path] = {}
        self._handles = {}
        for file in files:
            handle = self._handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            self.file_of.update((name, file) for name in handle.keys())

    def tensor(self, name: str) -> torch.Tensor:
        return self._handles[self.file_of[name]].get_tensor(name)

    def weight(self, name: str, block: tuple[int, int] | None) -> torch.Tensor | BlockFp8Tensor:
        """The tensor, or for an FP8 weight the weight with its block scales."""
        tensor = self.tensor(name)
        if tensor.dtype != FP8_DTYPE:
            return tensor
        scale_name = name + _SCALE_SUFFIX
        if scale_name not in self.file_of:
            raise ValueError(f"{self.file_of[name].name}: FP8 weight {name!r} has no {scale_name!r} (only block-wise "
                             "FP8 checkpoints are supported)")
        if block is None:
            raise ValueError(f"{self.file_of[name].name}: weight {name!r} is FP8 but config.json has no "
                             "quantization_config naming its weight_block_size")
        scale = self.tensor(scale_name).float()
        expected = (*tensor.shape[:-2], -(-tensor.shape[-2] // block[0]), -(-tensor.shape[-1] // block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{self.file_of[scale_name].name}: {scale_name!r} has shape {tuple(scale.shape)}, but "
                             f"{block[0]}x{block[1]} blocks of a {tuple(tensor.shape)} weight need {expected}")
        return BlockFp8Tensor(tensor, scale, block)


def load_safetensors(model: nn.Module, model_dir: pathlib.Path) -> None:
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (use --load-format dummy for random weights)")
    params = dict(model.named_parameters())   # a tied lm_head is the embedding: listed once
    tied = getattr(model.config, "tie_word_embeddings", False)
    quant = getattr(model, "quant_config", None)
    block = quant.block if quant is not None else None
    filled: set[tuple[str, object]] = set()
    with contextlib.ExitStack() as stack:
        checkpoint = _Checkpoint(files, stack)
        for name, file in checkpoint.file_of.items():
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight") or is_attention_scale(name):
                continue   # KV-cache scales: worker_svc/kv_cache_scales.py reads them
            if name.endswith(_SCALE_SUFFIX) and name.removesuffix(_SCALE_SUFFIX) in checkpoint.file_of:
                continue   # loaded with its weight
            target, shard_id = _target(name, model)
            if target not in params:
                raise ValueError(f"{file.name}: weight {name!r} has no place in {type(model).__name__}")
            param = params[target]
            getattr(param, "weight_loader", _default_loader)(param, checkpoint.weight(name, block), shard_id)
            filled.add((target, shard_id))
    missing = expected_parts(model) - filled
    if missing:
        listed = ", ".join(sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)[:8])
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} weights, e.g. {listed}")
    logger.info("loaded %d tensors from %d safetensors file(s) in %s", len(filled), len(files), model_dir)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights for benchmarks: only the shapes matter. Norm scales are 1 and biases 0 so
    activations stay finite; the same seed gives the same weights on the same device. An FP8
    weight is drawn in bfloat16 and quantized (its `init_dummy`), which also fills its scales."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if getattr(param, "shard_ids", None) == ():
            continue   # filled with its weight
        if hasattr(param, "init_dummy"):
            param.init_dummy(generator, std)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
