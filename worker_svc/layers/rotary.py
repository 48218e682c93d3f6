"""Rotary position embedding with a precomputed cos/sin table (neox layout: halves rotate), and
the path from a packed qkv projection through Qwen3's q/k norm and RoPE into the KV cache."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.layers.attention.layer import PagedAttention
from worker_svc.layers.layernorm import RMSNorm

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

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Each token's cos | sin row: [num_tokens, head_dim] float32."""
        return self.cos_sin[positions]


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [num_tokens, num_heads, head_dim] in float32 and returns it in x's dtype."""
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)   # broadcast over heads
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def norm_and_rotate_qkv(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos_sin: torch.Tensor,
                        num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits a packed [q | k | v] projection into q, k, v [num_tokens, heads, head_dim], with
    Qwen3's per-head RMSNorm and then RoPE applied to q and k. On CUDA one kernel does both, in
    place over qkv (q, k and v are then views of it)."""
    head_dim = q_norm.weight.shape[0]
    fused = False
    if qkv.is_cuda:
        from worker_svc.layers import fused_kernels   # imports Triton, which CUDA installs have

        fused = fused_kernels.ENABLED
        if fused:
            fused_kernels.qk_norm_rope_(qkv, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps, cos_sin,
                                        num_heads, num_kv_heads)
    heads = (num_heads, num_kv_heads, num_kv_heads)
    q, k, v = (part.view(-1, n, head_dim) for part, n in zip(qkv.split([n * head_dim for n in heads], dim=-1), heads))
    if not fused:
        q, k = apply_rotary(q_norm(q), cos_sin), apply_rotary(k_norm(k), cos_sin)
    return q, k, v


def attend_qkv(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos_sin: torch.Tensor, attn: PagedAttention,
               meta: AttentionMetadata, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Attention output [num_tokens, num_heads, head_dim] of a packed [q | k | v] projection:
    Qwen3's q/k norm and RoPE, the step's K/V into attn's cache, then attention. On CUDA one
    kernel does all but the attention (attention/qkv_store.py) and the backend only attends; a
    pure-decode step of few rows has its attention launch do it all where its backend can
    (attention/decode_qk.py)."""
    if qkv.is_cuda:
        from worker_svc.layers import fused_kernels   # imports Triton, which CUDA installs have

        if fused_kernels.ENABLED:
            from worker_svc.layers.attention import decode_qk, qkv_store

            if meta.is_pure_decode and attn.backend.fuses_decode_qk and decode_qk.takes(qkv.shape[0]):
                head_dim = q_norm.weight.shape[0]
                q = qkv[:, :num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
                return attn.attend_decode_qk(q, decode_qk.DecodeQK(qkv, q_norm.weight, k_norm.weight, q_norm.eps,
                                                                   k_norm.eps, cos_sin, meta.slot_mapping), meta)
            q = qkv_store.qk_norm_rope_store(qkv, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps, cos_sin,
                                             num_heads, num_kv_heads, attn.k_cache, attn.v_cache,
                                             meta.slot_mapping, attn.kv_scales)
            return attn.attend(q, meta)
    q, k, v = norm_and_rotate_qkv(qkv, q_norm, k_norm, cos_sin, num_heads, num_kv_heads)
    return attn(q, k, v, meta)
