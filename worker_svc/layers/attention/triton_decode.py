"""The Triton decode kernel: attention of one query token per request over its paged context,
shaped for a KV cache the tensor cores cannot read as it is stored (FP8), and for GQA groups of
a few heads.

One program covers one kv head of one request (and one split of its context, see
triton_split_merge.py), and all the query heads of that kv head at once. It computes the scores
transposed, S^T = K Q^T: the keys are the tensor-core tile's rows and the group's heads its
columns, padded to COLS (>= 8, an MMA's narrowest), so a GQA-2 decode pays for 8 columns
rather than for a 16-row query tile. The next K/V tile is loaded into registers while the current
one is used, and converted to the dot's type there (e4m3 -> float16: one instruction per pair);
the converted tiles reach the MMA through shared memory in 16-bit form, as a bfloat16 cache's do.
The loop-carried tiles are also what lets the compiler lay the dots out for 16-bit operands
(it sizes a dot's operand layout after the narrowest load that feeds it). Without USE_DOT the
products are float32 FMAs on the CUDA cores over exactly the group's heads (COLS = GROUP_PAD),
with no shared-memory round trip: a GQA-2 decode is 2 MACs per key element.

In a batch that mixes prefill chunks with decodes (PURE_DECODE false) the programs of requests
computing more than one token return at once: the tile kernel (triton_kernels.py) takes those.
"""
from __future__ import annotations

import triton
import triton.language as tl

from worker_svc.layers.attention import decode_qk
from worker_svc.layers.attention.triton_split_merge import _active_splits, _write_result
from worker_svc.layers.pdl_launch import pdl_start

F16_MAX = tl.constexpr(65504.0)


@triton.jit
def _kv_tile(block_table, kv_start, kv_hi, kv_head, dim_valid, stride_cb, stride_cs, stride_ch,
             BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr):
    """Where keys kv_start.. of one request and kv head sit in the paged cache: their positions,
    which of them lie below kv_hi, each one's offset, and the mask of a [KV_TILE, DIM_PAD] load
    (the tile kernel's too, triton_kernels.py)."""
    kv_pos = kv_start + tl.arange(0, KV_TILE)
    kv_valid = kv_pos < kv_hi
    block = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
    kv_offset = block * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = kv_valid[:, None] & dim_valid[None, :]
    return kv_pos, kv_valid, kv_offset, kv_mask


@triton.jit
def _grid_ids(HEADS_FIRST: tl.constexpr):
    """(request or query tile, kv head) of this program: the grid's first two axes, in the order
    LaunchConfig.heads_first gave them (triton_kernels._grid)."""
    if HEADS_FIRST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table, kv_start, kv_hi, kv_head, dims, dim_valid,
                  stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr):
    """K and V [KV_TILE, DIM_PAD] of keys kv_start.. of one request and kv head, as stored; keys
    at kv_hi and past it read as zeros (nothing is loaded for them)."""
    _, _, kv_offset, kv_mask = _kv_tile(block_table, kv_start, kv_hi, kv_head, dim_valid, stride_cb, stride_cs,
                                        stride_ch, BLOCK_SIZE, KV_TILE)
    k = tl.load(k_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _scores_t(k, q_t, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """K [KV_TILE, DIM_PAD] @ Q^T [DIM_PAD, COLS], on tensor cores or as float32 FMAs."""
    if USE_DOT:
        s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION)
    else:
        s_t = tl.sum(k[:, :, None].to(tl.float32) * q_t[None, :, :].to(tl.float32), 1)
    return s_t


@triton.jit
def _values_t(v, p_t, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """V^T [DIM_PAD, KV_TILE] @ P^T [KV_TILE, COLS], on tensor cores or as float32 FMAs."""
    if USE_DOT:
        o_t = tl.dot(tl.trans(v), p_t, input_precision=DOT_PRECISION)
    else:
        o_t = tl.sum(v[:, :, None].to(tl.float32) * p_t[:, None, :].to(tl.float32), 0)
    return o_t


# Not specialised (Triton would compile a variant for 1, for multiples of 16 and for the rest): both
# change from step to step, and a variant first met mid-serving stalls the batch (PERF_NOTES v27).
@triton.jit(do_not_specialize=["num_requests", "stride_bt"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, order_ptr,
    k_scale_ptr, v_scale_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_requests,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    q_weight_ptr, k_weight_ptr, cos_sin_ptr, slot_ptr, k_inv_ptr, v_inv_ptr, stride_rope, q_eps, k_eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    COLS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, PURE_DECODE: tl.constexpr, FUSED_MERGE: tl.constexpr,
    MERGE_CHUNK: tl.constexpr, KV_FP8: tl.constexpr, DOT_F16: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr, TRIGGER: tl.constexpr, ORDERED: tl.constexpr, HEADS_FIRST: tl.constexpr,
    WAIT: tl.constexpr, FUSED_QK: tl.constexpr,
):
    # TRIGGER: the o projection after it may launch now (pdl_launch.pdl_triggers); WAIT: launched
    # with PDL, it waits for the kernel before it (the q/k norm + RoPE + store, or with FUSED_QK the qkv
    # projection) first (pdl_launch.pdl_waits). FUSED_QK (pure decode only): q_ptr is the raw packed
    # projection, whose q/k norm, RoPE and K/V store this launch does itself (decode_qk.py).
    pdl_start(TRIGGER, WAIT)
    request, kv_head = _grid_ids(HEADS_FIRST)
    split = tl.program_id(2)
    if PURE_DECODE:
        if ORDERED:   # program i takes the i-th longest context (AttentionMetadata.decode_order)
            request = tl.load(order_ptr + request)
        token = request.to(tl.int64)
    else:
        token = tl.load(query_start_loc_ptr + request).to(tl.int64)
        if tl.load(query_start_loc_ptr + request + 1) - token != 1:
            return
    seq_len = tl.load(seq_lens_ptr + request)   # the query token is the last of them: it sees every key

    cols = tl.arange(0, COLS)
    col_valid = cols < GROUP
    head = kv_head * GROUP + cols
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_mask = dim_valid[:, None] & col_valid[None, :]
    if not FUSED_QK:
        q_t = tl.load(q_ptr + token * stride_qt + head[None, :] * stride_qh + dims[:, None], mask=q_mask,
                      other=0.0)   # [DIM_PAD, COLS]
    if KV_FP8:  # scores and values come out in stored units: the scales apply once, outside the loop
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)

    kv_per_split = tl.cdiv(tl.cdiv(seq_len, KV_TILE), NUM_SPLITS) * KV_TILE
    active = _active_splits(seq_len, kv_per_split, NUM_SPLITS, FUSED_MERGE)
    if split >= active:   # no keys in this split's slice, and nothing of it to merge
        return
    kv_lo = split * kv_per_split
    kv_hi = tl.minimum(seq_len, kv_lo + kv_per_split)
    if FUSED_QK:   # after the return above: a split without keys has no use for q
        q_t = decode_qk.norm_rope(q_ptr + token * stride_qt + head[None, :] * stride_qh, dims[:, None] + cols[None, :] * 0,
                                  q_mask, q_weight_ptr, cos_sin_ptr + token * stride_rope, q_eps, 0, HEAD_DIM // 2)
        if decode_qk.owns_new_key(split, seq_len, kv_per_split):
            decode_qk.store_new_kv(q_ptr, token, kv_head, stride_qt, k_weight_ptr, cos_sin_ptr + token * stride_rope,
                                   k_eps, slot_ptr, k_cache_ptr, v_cache_ptr, k_inv_ptr, v_inv_ptr, stride_cb,
                                   stride_cs, stride_ch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DIM_PAD, BLOCK_SIZE,
                                   KV_FP8)
    if not USE_DOT:  # CUDA-core products in float32
        q_t = q_t.to(tl.float32)
    elif DOT_F16:  # e4m3 -> f16 is one instruction per pair (-> bf16 costs one more per element)
        q_t = tl.minimum(tl.maximum(q_t.to(tl.float32), -F16_MAX), F16_MAX).to(tl.float16)
    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined for heads that see no key.
    m_i = tl.full([COLS], -1.0e30, tl.float32)
    l_i = tl.zeros([COLS], tl.float32)
    acc_t = tl.zeros([DIM_PAD, COLS], tl.float32)
    block_table = block_tables_ptr + request.to(tl.int64) * stride_bt
    k_next, v_next = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table, kv_lo, kv_hi, kv_head, dims, dim_valid,
                                   stride_cb, stride_cs, stride_ch, BLOCK_SIZE, KV_TILE)
    k = k_next.to(q_t.dtype)
    v = v_next.to(q_t.dtype)
    for kv_start in range(kv_lo, kv_hi, KV_TILE):
        k_next, v_next = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table, kv_start + KV_TILE, kv_hi, kv_head,
                                       dims, dim_valid, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, KV_TILE)
        kv_valid = kv_start + tl.arange(0, KV_TILE) < kv_hi
        s_t = _scores_t(k, q_t, USE_DOT, DOT_PRECISION) * qk_scale   # [KV_TILE, COLS]
        s_t = tl.where(kv_valid[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        p_t = tl.exp2(s_t - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p_t, 0)
        acc_t = acc_t * alpha[None, :] + _values_t(v, p_t.to(q_t.dtype), USE_DOT, DOT_PRECISION)
        m_i = m_new
        k = k_next.to(q_t.dtype)   # converted after this tile's work, when the loads have landed
        v = v_next.to(q_t.dtype)

    out_scale = 1.0
    if KV_FP8:
        out_scale = tl.load(v_scale_ptr + kv_head)
    token_col = token + cols * 0
    _write_result(tl.trans(acc_t), m_i, l_i, out_scale, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
                  token_col, head, col_valid, dims, dim_valid, request, kv_head, split, active, token, stride_ot,
                  stride_oh,
                  NUM_HEADS, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, DIM_PAD, NUM_SPLITS, FUSED_MERGE, MERGE_CHUNK)
