"""One Triton kernel from the packed qkv projection to the KV cache: Qwen3's per-head RMSNorm of
q and k, RoPE, and the store of the step's K and V at their slots (quantized for an FP8 cache),
where the unfused path takes three launches (fused_kernels.qk_norm_rope_, then the backend's
store kernel).

One program per token covers all its heads: rows of its tile are the q heads then the k heads,
columns one half of head_dim (RoPE's neox layout pairs the halves). q is written back in place
(the attention reads it from qkv); k and v go only to the cache. Values round to the model dtype
where the torch path rounds (rotary.py, layernorm.py) before they are stored, so the cache holds
the same bytes as after the unfused path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_svc.layers import pdl_launch
from worker_svc.layers.attention.kv_quant import KVScales, is_fp8
from worker_svc.layers.attention.decode_qk import to_cache
from worker_svc.layers.fused_kernels import qk_norm_rope_tile
from worker_svc.layers.pdl_launch import pdl_start


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_inv_ptr, v_inv_ptr,
    stride_qkv, stride_cs, q_eps, k_eps, stride_cb, stride_cs_slot, stride_ch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
    TRIGGER: tl.constexpr, WAIT: tl.constexpr,
):
    # TRIGGER: the attention after it may launch now; WAIT: launched with PDL, it waits for the qkv
    # projection's end first (pdl_launch.pdl_chain_args)
    pdl_start(TRIGGER, WAIT)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF_PAD)
    num_heads = NUM_Q_HEADS + NUM_KV_HEADS
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]
    row = qkv_ptr + token * stride_qkv
    first = row + (heads * (2 * HALF))[:, None] + cols[None, :]
    y1, y2 = qk_norm_rope_tile(first, mask, heads, cols, q_weight_ptr, k_weight_ptr, cos_sin_ptr + token * stride_cs,
                               q_eps, k_eps, NUM_Q_HEADS, HALF)
    q_mask = mask & (heads < NUM_Q_HEADS)[:, None]
    tl.store(first, y1, mask=q_mask)
    tl.store(first + HALF, y2, mask=q_mask)

    # Slot -1: padding (CUDA-graph batches) or a token whose K/V are not kept.
    slot = tl.load(slot_ptr + token)
    keep = slot >= 0
    cache_row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs_slot
    kv_head = tl.where(heads >= NUM_Q_HEADS, heads - NUM_Q_HEADS, 0)
    k_mask = mask & (heads >= NUM_Q_HEADS)[:, None] & keep
    k_inv = 1.0
    if KV_FP8:
        k_inv = tl.load(k_inv_ptr + kv_head, mask=heads < num_heads, other=1.0)[:, None]
    k_dst = k_cache_ptr + cache_row + (kv_head * stride_ch)[:, None] + cols[None, :]
    tl.store(k_dst, to_cache(y1, k_inv, k_cache_ptr, KV_FP8), mask=k_mask)
    tl.store(k_dst + HALF, to_cache(y2, k_inv, k_cache_ptr, KV_FP8), mask=k_mask)

    # V: the kv heads after q and k, whole head_dim per row.
    kv_rows = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, 2 * HALF_PAD)
    v_mask = (kv_rows < NUM_KV_HEADS)[:, None] & (dims < 2 * HALF)[None, :] & keep
    v = tl.load(row + num_heads * 2 * HALF + (kv_rows * (2 * HALF))[:, None] + dims[None, :], mask=v_mask)
    v_inv = 1.0
    if KV_FP8:
        v_inv = tl.load(v_inv_ptr + kv_rows, mask=kv_rows < NUM_KV_HEADS, other=1.0)[:, None]
    v_dst = v_cache_ptr + cache_row + (kv_rows * stride_ch)[:, None] + dims[None, :]
    tl.store(v_dst, to_cache(v, v_inv, v_cache_ptr, KV_FP8), mask=v_mask)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def qk_norm_rope_store(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float,
                       k_eps: float, cos_sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_scales: KVScales | None = None) -> torch.Tensor:
    """For qkv [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]: normalises and rotates
    q in place and returns it as a [num_tokens, num_q_heads, head_dim] view; stores each token's
    normalised, rotated k and its v in the caches at slot_mapping (slot -1: not stored)."""
    head_dim = q_weight.shape[0]
    num_tokens = qkv.shape[0]
    assert head_dim % 2 == 0 and qkv.stride(-1) == 1 and cos_sin.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim and cos_sin.shape == (num_tokens, head_dim)
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    q = qkv[:, :num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    if num_tokens == 0:
        return q
    fp8 = is_fp8(k_cache)
    if fp8 and kv_scales is None:
        raise ValueError("an fp8 KV cache needs its layer's KVScales")
    _qk_norm_rope_store_kernel[(num_tokens,)](
        qkv, q_weight, k_weight, cos_sin, slot_mapping, k_cache, v_cache,
        kv_scales.k_inv if fp8 else cos_sin, kv_scales.v_inv if fp8 else cos_sin,
        qkv.stride(0), cos_sin.stride(0), q_eps, k_eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_pow2(num_q_heads + num_kv_heads),
        KV_HEADS_PAD=_pow2(num_kv_heads), HALF=head_dim // 2, HALF_PAD=_pow2(head_dim // 2),
        BLOCK_SIZE=k_cache.shape[1], KV_FP8=fp8, **pdl_launch.pdl_chain_args(qkv.device), num_warps=4,
    )
    return q
