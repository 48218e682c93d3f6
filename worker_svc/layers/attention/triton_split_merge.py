"""How a paged-attention program of this project's Triton kernels (triton_kernels.py,
triton_decode.py) leaves its result: the normalised output of its rows when it saw the whole
context, else its split's partial output and log-sum-exp ("flash decoding"), merged either by the
split that finishes its (request, kv head) last, as counted by an atomic counter, or by
`_merge_splits_kernel` launched afterwards.

Partials are contiguous float32 [num_tokens, num_heads, num_splits, head_dim] (log-sum-exps
without the last axis); a counter per (request, kv head) is zero before a launch and left zero
after it.

A launch's split factor comes from the batch shape alone (a captured graph replays it at every
context length), so a short context leaves splits without keys: 48 of a 1 x 1024 decode's 64
(PERF_NOTES v40). With the fused merge those return at once (`_active_splits`): the counter
counts the splits that hold keys, and the last of them merges only their partials. A separate
merge launch reads every split's, so there every split writes one.
"""
from __future__ import annotations

import triton
import triton.language as tl

from worker_svc.layers.pdl_launch import pdl_start


@triton.jit
def _active_splits(kv_end, kv_per_split, NUM_SPLITS: tl.constexpr, FUSED_MERGE: tl.constexpr):
    """How many of a launch's splits take part in a (request, kv head)'s result: with the fused
    merge those whose slice of kv_end keys (kv_per_split each) is not empty, at least one (a padded
    request without keys still writes its zeros); every split otherwise."""
    if FUSED_MERGE:
        return tl.maximum(tl.cdiv(kv_end, tl.maximum(kv_per_split, 1)), 1)
    return NUM_SPLITS


@triton.jit
def _write_result(acc, m_i, l_i, out_scale, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
                  token, head, row_valid, dims, dim_valid, request, kv_head, split, active, merge_token,
                  stride_ot, stride_oh,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                  GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, FUSED_MERGE: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """acc [rows, DIM_PAD] with its running max m_i and sum l_i [rows] (base 2) for the rows
    (token, head) of one program; out_scale multiplies the output (an FP8 cache's V scale).
    active: the splits taking part (_active_splits); merge_token: the one query token of a split
    decode, whose heads of kv_head the last of them merges."""
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None] * out_scale
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out_offset = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)
        if FUSED_MERGE:
            # Every thread's partials are written before one of them counts this split done
            # (release); the program that counts last sees them all (acquire) and merges.
            tl.debug_barrier()
            counter = counter_ptr + request * NUM_KV_HEADS + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == active - 1:
                _merge_group(part_out_ptr, part_lse_ptr, out_ptr, merge_token, kv_head, active, stride_ot, stride_oh,
                             NUM_HEADS, GROUP, GROUP_PAD, HEAD_DIM, DIM_PAD, NUM_SPLITS, MERGE_CHUNK)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")   # ready for the next launch


@triton.jit
def _merge_group(part_out_ptr, part_lse_ptr, out_ptr, token, kv_head, active, stride_ot, stride_oh,
                 NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """One decode token's output for the query heads of one kv head, from the partials of its
    first `active` splits, each weighted by its split's share of the softmax (heads no split saw:
    0). The partials are read SPLIT_CHUNK splits at a time, past L1: other programs wrote them
    during this launch."""
    g = tl.arange(0, GROUP_PAD)
    g_valid = g < GROUP
    head = kv_head * GROUP + g
    first = (token * NUM_HEADS + head) * NUM_SPLITS   # each head's first partial
    splits = tl.arange(0, NUM_SPLITS)
    lse = tl.load(part_lse_ptr + first[:, None] + splits[None, :], mask=g_valid[:, None] & (splits < active)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)   # every split empty (a padded request)
    total = tl.sum(tl.exp2(lse - m[:, None]), 1)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    chunk = tl.arange(0, SPLIT_CHUNK)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(0, active, SPLIT_CHUNK):
        taken = g_valid[:, None] & (start + chunk < active)[None, :]
        part = first[:, None] + start + chunk[None, :]
        weight = tl.exp2(tl.load(part_lse_ptr + part, mask=taken, other=float("-inf"), cache_modifier=".cg")
                         - m[:, None])
        partial = tl.load(part_out_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :],
                          mask=taken[:, :, None] & dim_valid[None, None, :], other=0.0, cache_modifier=".cg")
        acc += tl.sum(partial * weight[:, :, None], 1)
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_valid[:, None] & dim_valid[None, :])


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, ONE_TOKEN_REQUESTS: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr,
):
    """One program per (query token, head): its output from its partials. ONE_TOKEN_REQUESTS:
    the first axis counts requests instead, and only those computing one token were split."""
    pdl_start(TRIGGER, WAIT)   # as the attention kernels' (the kernel before it: theirs)
    token = tl.program_id(0).to(tl.int64)
    if ONE_TOKEN_REQUESTS:
        request = tl.program_id(0)
        token = tl.load(query_start_loc_ptr + request).to(tl.int64)
        if tl.load(query_start_loc_ptr + request + 1) - token != 1:
            return
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM_PAD)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + part)
    lse_max = tl.max(lse, 0)
    # Every split empty (a padded request with no context): weights 0, output 0.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)
    partial = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                      mask=(dims < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
