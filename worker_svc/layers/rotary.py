"""Rotary position embedding with a precomputed cos/sin table (neox layout: halves rotate)."""
from __future__ import annotations

import torch
from torch import nn

# RoPE variants whose frequencies do not depend on the sequence length, so one table serves
# every position. "dynamic" and "longrope" rescale with the length and are not supported.
_STATIC_SCALED_ROPE = ("linear", "yarn", "llama3")


def rope_settings(config) -> dict:
    """The RoPE parameters whether the config carries transformers-5 `rope_parameters` or the
    older top-level `rope_theta` (with optional `rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, scale applied to cos and sin). `config` is a
    transformers config or worker_svc.model_config's namespace."""
    params = rope_settings(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type in _STATIC_SCALED_ROPE:
        # The scaled variants' formulas are transformers' own; reuse them rather than re-derive.
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf_config = Qwen3Config(**config.raw) if hasattr(config, "raw") else config
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        return inv_freq.float(), float(attention_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}: supported are default and {', '.join(_STATIC_SCALED_ROPE)}")


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling
        # float32 whatever the model dtype, and not a checkpoint weight. Built on the CPU, where
        # the frequencies come from, then moved to the device the model is being built on.
        self.register_buffer("cos_sin", cos_sin.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [num_tokens, 1, head_dim / 2], broadcast over heads."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [num_tokens, num_heads, head_dim] in float32 and returns it in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
