"""Qwen3's q/k norm, RoPE and the KV store inside a pure-decode attention launch (PERF_NOTES v48).

Elsewhere one kernel takes a step's packed qkv projection to the cache (qkv_store.py) and the
attention launch after it reads the normalised, rotated q back. At a few rows that kernel and its
boundary in the decode layer's chain cost more than their work (~2.6 us a layer plus the latency of one
more dependent launch, PERF_NOTES v46-v47), so a pure-decode launch can take the raw projection
instead: every program normalises and rotates its own query heads as it loads them (a few hundred
FLOPs), and the program whose split holds the request's newest position (the last, `owns_new_key`)
normalises, rotates and stores that position's key and value for its kv head before it reads any key:
a CTA barrier orders the store before the program's own loads, and no other program reads that
position. That last holds because no request of a step reads a slot another one writes in it: the
block manager shares a block only once it is full and computed, so each new token lands in a block
its request alone holds (test_scheduler_properties checks it on every step). A step that broke it
(synthetic_step's shared pool does) would read such a slot before or after its store as the programs
happen to run. Values round where the torch path rounds (fused_kernels.qk_norm_rope_tile), so the
cache holds the unfused path's bytes but where a float32 sum's order flips a rounding.

Pure-decode steps of up to MAX_ROWS rows take it (WORKER_ATTENTION_DECODE_QK_ROWS, default 64; 0: none).
Timed on two H100s (Qwen3-0.6B, context 1024, device ms a step against the separate kernel, two runs
each, PERF_NOTES v50): 1 row 1.06 -> 1.02 and 1.09-1.11 -> 1.06-1.07, 16 rows 1.96-1.99 -> 1.86-1.91,
64 rows 3.81-3.83 -> 3.77-3.83; 128 rows 6.48-6.49 -> 6.52 and 256 rows 11.65 -> 11.76, losses (not profiled:
there the separate kernel's cost is a small part of a step that attention's KV reads set).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker_svc.layers.attention.kv_quant import FP8_KV_MAX, KVScales
from worker_svc.layers.fused_kernels import rms_normed

MAX_ROWS = int(os.environ.get("WORKER_ATTENTION_DECODE_QK_ROWS", "64"))


def takes(num_tokens: int) -> bool:
    """Whether a pure-decode step of num_tokens rows runs it (a CUDA graph's padded size at capture)."""
    return num_tokens <= MAX_ROWS


FP8_MAX = tl.constexpr(FP8_KV_MAX)


@dataclass(frozen=True)
class DecodeQK:
    """What a pure-decode launch needs to do the q/k norm, RoPE and KV store itself: q is then the
    [num_tokens, num_heads, head_dim] view of the packed projection's q part, as it left the projection."""
    qkv: torch.Tensor           # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rows contiguous
    q_weight: torch.Tensor      # the per-head RMSNorms' weights [head_dim]
    k_weight: torch.Tensor
    q_eps: float
    k_eps: float
    cos_sin: torch.Tensor       # float32 [num_tokens, head_dim]: cos | sin of each token's position
    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each token's K/V go; -1: not stored

    def check(self, q: torch.Tensor, num_kv_heads: int) -> None:
        num_tokens, num_heads, head_dim = q.shape
        width = (num_heads + 2 * num_kv_heads) * head_dim
        assert head_dim % 2 == 0 and self.qkv.shape == (num_tokens, width) and self.qkv.stride(-1) == 1
        # (a one-row view may carry any row stride: its row 0 is the only one read)
        own = q.data_ptr() == self.qkv.data_ptr() and q.stride()[1:] == (head_dim, 1)
        assert own and (num_tokens == 1 or q.stride(0) == self.qkv.stride(0)), \
            "q must be the packed projection's own q part"
        assert self.cos_sin.shape == (num_tokens, head_dim) and self.cos_sin.stride(-1) == 1
        assert self.slot_mapping.shape == (num_tokens,)

    def args(self, scales: KVScales | None) -> tuple:
        """The attention kernels' arguments for it (after _Step.args' own)."""
        return (self.q_weight, self.k_weight, self.cos_sin, self.slot_mapping,
                scales.k_inv if scales else self.cos_sin, scales.v_inv if scales else self.cos_sin,
                self.cos_sin.stride(0), self.q_eps, self.k_eps)


def placeholder_args(out: torch.Tensor) -> tuple:
    """The same arguments for a launch that does not take the raw projection (FUSED_QK false)."""
    return (out, out, out, out, out, out, 0, 0.0, 0.0)


@triton.jit
def to_cache(x, inv_scale, cache_ptr, KV_FP8: tl.constexpr):
    """x as the cache stores it: for FP8, float32 x * inv_scale clamped and rounded to e4m3
    (kv_quant.quantize); otherwise cast to the cache's type. (Every Triton K/V writer stores through it.)"""
    if KV_FP8:
        scaled = x.to(tl.float32) * inv_scale
        return tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX).to(cache_ptr.dtype.element_ty)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def norm_rope(head_ptr, dim, mask, weight_ptr, cos_sin_row, eps, AXIS: tl.constexpr, HALF: tl.constexpr):
    """Head vectors laid along AXIS of a tile (head_ptr: each element's head's first element, dim:
    its index in the head, both of the tile's shape), RMS-normalised with weight_ptr's weights and
    rotated by RoPE (neox: the halves pair), in the model dtype: rounded as qk_norm_rope_tile rounds."""
    dtype = head_ptr.dtype.element_ty
    partner = (dim + HALF) % (2 * HALF)
    x = tl.load(head_ptr + dim, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(head_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.expand_dims(tl.rsqrt(tl.sum(x * x, AXIS) / (2 * HALF) + eps), AXIS)
    w = tl.load(weight_ptr + dim, mask=mask, other=0.0).to(tl.float32)
    w_partner = tl.load(weight_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    n = rms_normed(x, rstd, w, dtype).to(tl.float32)
    n_partner = rms_normed(x_partner, rstd, w_partner, dtype).to(tl.float32)
    half = dim % HALF
    cos = tl.load(cos_sin_row + half, mask=mask, other=0.0)
    sin = tl.load(cos_sin_row + HALF + half, mask=mask, other=0.0)
    # first half: n1 cos - n2 sin; second: n2 cos + n1 sin (qk_norm_rope_tile's expressions)
    return tl.where(dim < HALF, n * cos - n_partner * sin, n * cos + n_partner * sin).to(dtype)


@triton.jit
def owns_new_key(split, seq_len, kv_per_split):
    """Whether this split's slice holds the request's newest position (seq_len - 1; a request
    without keys: split 0)."""
    return split == (tl.maximum(seq_len, 1) - 1) // tl.maximum(kv_per_split, 1)


@triton.jit
def store_new_kv(qkv_ptr, token, kv_head, stride_qt, k_weight_ptr, cos_sin_row, k_eps, slot_ptr, k_cache_ptr,
                 v_cache_ptr, k_inv_ptr, v_inv_ptr, stride_cb, stride_cs, stride_ch,
                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr):
    """The token's key (normalised, rotated) and value of one kv head into the caches at its slot
    (quantized for an FP8 cache; slot -1: nothing), then a barrier: the program's later loads
    (every thread's) see them."""
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)[None, :]   # [1, DIM_PAD]: one head along axis 1
    mask = (dims < HEAD_DIM) & (slot >= 0)
    row = qkv_ptr + token * stride_qt
    k = norm_rope(row + (NUM_HEADS + kv_head) * HEAD_DIM + dims * 0, dims, mask, k_weight_ptr, cos_sin_row, k_eps,
                  1, HEAD_DIM // 2)
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + dims, mask=mask)
    k_inv = 1.0
    v_inv = 1.0
    if KV_FP8:
        k_inv = tl.load(k_inv_ptr + kv_head)
        v_inv = tl.load(v_inv_ptr + kv_head)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch + dims
    tl.store(k_cache_ptr + dst, to_cache(k, k_inv, k_cache_ptr, KV_FP8), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_inv, v_cache_ptr, KV_FP8), mask=mask)
    tl.debug_barrier()
