"""Qwen3MoeForCausalLM: Qwen3 whose MLP is, in its sparse layers, a mixture of experts.

Everything but the MLP is the dense model's (models/qwen3.py). Layer i is sparse, as in
transformers' Qwen3MoeDecoderLayer, unless it is listed in `mlp_only_layers`, when the model
has experts and (i + 1) is a multiple of `decoder_sparse_step`; the other layers keep a dense
MLP of `intermediate_size`. A sparse layer's MLP is worker_svc.layers.moe.SparseMoeBlock.
"""
from __future__ import annotations

from torch import nn

from worker_svc.layers.fp8 import Fp8Config
from worker_svc.layers.moe import SparseMoeBlock
from worker_svc.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in config.mlp_only_layers and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # checkpoint expert projection -> (stacked parameter, its part); see loader._target.
    expert_modules_mapping = {
        "gate_proj": ("w13_weight", "gate"),
        "up_proj": ("w13_weight", "up"),
        "down_proj": ("w2_weight", "down"),
    }

    @staticmethod
    def _mlp(config, layer_idx: int, prefix: str, quant: Fp8Config | None) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return Qwen3MLP(config, prefix, quant)
        experts_quant = quant.for_modules(f"{prefix}.experts") if quant is not None else None
        return SparseMoeBlock(config, experts_quant)
