"""This project's Triton kernels for attention over the paged KV cache, and their launch.

- `_store_kv_kernel`: writes the step's new K/V rows into the cache at their slots (quantized
  for an FP8 cache, see kv_quant.py). On CUDA the model stores through qkv_store.py instead,
  fused with q/k norm and RoPE; this one serves the backends' own `forward`.
- `_paged_attention_kernel` (the tile kernel): causal attention of every query token over its
  request's paged context. One program handles one kv head for a tile of query tokens of one
  request, and all the query heads that share that kv head (GQA): the K/V tile it loads is used
  by the whole group, so KV bytes are read once per kv head rather than once per query head.
  Rows of the tile are (query token, head in group) pairs, so a decode (one token) still fills a
  tensor-core tile with its group. Optionally split-K ("flash decoding", triton_split_merge.py).
- `_paged_decode_kernel` (triton_decode.py): one query token per request, the group's heads as
  the columns of a transposed tile, the next K/V tile prefetched into registers and converted
  there. Made for the FP8 cache, whose bytes the tile kernel's compiled code reads one at a time.
- An FP8 cache is read as e4m3 and converted on load: the kv head's K scale is folded into the
  softmax scale and its V scale into the final division, so the inner loop multiplies nothing.

Which kernel and launch config a step gets depends on the cache's type and the batch: the tables
below (DECODE_LAUNCHES* by batch size, FP8_DECODE_KERNEL, PREFILL_LAUNCH*, MIXED_DECODES_APART*),
chosen on an H200 by bench/stages/attention.py's sweep. A batch that mixes prefill chunks with decodes may send its
one-token requests to the decode kernel and the rest to the tile kernel: two launches.

Pure-decode launches depend only on tensor shapes (never on context lengths known on the host),
so they are safe to capture in a CUDA graph and replay with other lengths.

Cache layout (see base.py): [num_blocks, block_size, num_kv_heads, head_dim]; the last dim must
be contiguous.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from worker_svc.layers import pdl_launch
from worker_svc.layers.attention import base as attention_base
from worker_svc.layers.attention import decode_qk
from worker_svc.layers.attention.decode_qk import DecodeQK, to_cache
from worker_svc.layers.attention.kv_quant import KVScales, is_fp8
from worker_svc.layers.attention.triton_decode import F16_MAX, _grid_ids, _kv_tile, _paged_decode_kernel
from worker_svc.layers.attention.triton_split_merge import _active_splits, _merge_splits_kernel, _write_result
from worker_svc.layers.pdl_launch import pdl_start

LOG2_E = 1.4426950408889634
# The tile kernel; the decode kernel (one-token requests only) on tensor cores, or on CUDA cores.
TILES, GQA, GQA_FMA = "tiles", "gqa", "gqa-fma"


@dataclass(frozen=True)
class LaunchConfig:
    tile_rows: int   # tile kernel: rows of a query tile, (query token, head in group) pairs; >= 16
    kv_tile: int     # keys per inner-loop step; any cache block size works (each key finds its block)
    num_warps: int
    num_stages: int
    kernel: str = TILES
    # A pure-decode launch's grid with the kv heads as its fastest axis: the programs of one request's
    # kv heads start together (and a launch ordered longest first starts every kv head of the longest
    # contexts first), instead of one kv head's programs of every request before the next kv head's.
    heads_first: bool = False


# Chosen on an H200 (docs/PERF_NOTES.md, v1 and v11). Decode: (largest batch, config), the first
# entry that covers the batch (None: any batch).
DECODE_LAUNCHES = ((None, LaunchConfig(tile_rows=16, kv_tile=64, num_warps=4, num_stages=3)),)
# For measuring other tiles in the decode chain (PERF_NOTES v56): WORKER_ATTENTION_DECODE_TILE="KV_TILE,WARPS,STAGES"
# replaces the bf16 table's config at every batch.
if os.environ.get("WORKER_ATTENTION_DECODE_TILE"):
    _kv, _warps, _stages = (int(v) for v in os.environ["WORKER_ATTENTION_DECODE_TILE"].split(","))
    DECODE_LAUNCHES = ((None, LaunchConfig(tile_rows=16, kv_tile=_kv, num_warps=_warps, num_stages=_stages)),)
DECODE_LAUNCHES_FP8 = ((None, LaunchConfig(tile_rows=16, kv_tile=128, num_warps=4, num_stages=3)),)
# The decode kernel's table for an FP8 cache (bench/stages/attention.py on an H200, 2026-12-04:
# 1.16-1.31x the tile kernel at 1..256 x 1024, 1.42x bf16 KV at 256 x 1024).
FP8_DECODE_KERNEL = True
DECODE_LAUNCHES_FP8_GQA = ((1, LaunchConfig(tile_rows=16, kv_tile=32, num_warps=2, num_stages=1, kernel=GQA)),
                           (16, LaunchConfig(tile_rows=16, kv_tile=32, num_warps=4, num_stages=2, kernel=GQA)),
                           (None, LaunchConfig(tile_rows=16, kv_tile=32, num_warps=1, num_stages=2, kernel=GQA)))
# Pure-decode launches hand their programs out with a request's kv heads together (heads_first). On
# an H100 (PERF_NOTES v44, 256 requests): equal contexts 1-1.5% faster, and it is what makes longest-first
# (AttentionMetadata.decode_order) global: with the requests as the grid's fastest axis the longest
# contexts of the last kv heads still started last. Ragged contexts of 100-2048 tokens, longest first:
# bf16 0.4145 -> 0.3988 ms, FP8 0.3023 -> 0.2363; the service 76.4% -> 79.0% of its floor, with an FP8
# cache 1.37x the bf16 cache's (was 1.26x). WORKER_ATTENTION_HEADS_FIRST=0 turns it off.
DECODE_HEADS_FIRST = os.environ.get("WORKER_ATTENTION_HEADS_FIRST", "1") != "0"
PREFILL_LAUNCH = LaunchConfig(tile_rows=64, kv_tile=64, num_warps=4, num_stages=3)
PREFILL_LAUNCH_FP8 = LaunchConfig(tile_rows=64, kv_tile=128, num_warps=4, num_stages=3)
# In a batch mixing prefill chunks with decodes, the one-token requests go to the decode launch
# (only sensible when that launch is the decode kernel's).
MIXED_DECODES_APART = False
MIXED_DECODES_APART_FP8 = True
# Split decodes merge inside the attention launch (the last split of each kv head merges),
# reading this many partial elements at a time.
FUSED_SPLIT_MERGE = True
MERGE_ELEMENTS = 4096
# Split-K is sized to give the GPU about this many warps per multiprocessor.
DECODE_WARPS_PER_SM = int(os.environ.get("WORKER_ATTENTION_DECODE_WARPS_PER_SM", "8"))   # (the variable: v56's sweep)
MAX_DECODE_SPLITS = 64
STORE_TOKENS_PER_PROGRAM = 16
# The decode kernel's narrowest tile of query heads: an MMA's N.
MIN_DECODE_COLS = 8


@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_inv_ptr, v_inv_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, TOKENS: tl.constexpr, KV_FP8: tl.constexpr,
):
    # A program copies TOKENS tokens x all kv heads x head_dim; the last axis is (head, dim).
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    cols = tl.arange(0, HEADS_PAD * DIM_PAD)
    heads = cols // DIM_PAD
    dims = cols % DIM_PAD
    # Slot -1: padding (CUDA-graph batches) or a token whose KV is not kept.
    mask = (slots >= 0)[:, None] & ((heads < NUM_KV_HEADS) & (dims < HEAD_DIM))[None, :]
    dst = ((slots // BLOCK_SIZE) * stride_cb + (slots % BLOCK_SIZE) * stride_cs)[:, None] \
        + (heads * stride_ch + dims)[None, :]
    rows = tokens.to(tl.int64)[:, None]
    k_inv = 1.0
    v_inv = 1.0
    if KV_FP8:
        k_inv = tl.load(k_inv_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)[None, :]
        v_inv = tl.load(v_inv_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)[None, :]
    k = tl.load(k_ptr + rows * stride_kt + (heads * stride_kh + dims)[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, to_cache(k, k_inv, k_cache_ptr, KV_FP8), mask=mask)
    v = tl.load(v_ptr + rows * stride_vt + (heads * stride_vh + dims)[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_inv, v_cache_ptr, KV_FP8), mask=mask)


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    """Request owning global query tile `tile`. Request r owns tiles starting at
    query_start_loc[r] // BLOCK_Q + r: increasing in r, never overlapping, so a binary search
    finds it on the device without any host-built tile map."""
    lo = num_requests * 0
    hi = num_requests - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if mid_first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


# Not specialised (Triton would compile a variant for 1, for multiples of 16 and for the rest): both
# change from step to step, and a variant first met mid-serving stalls the batch (PERF_NOTES v27).
@triton.jit(do_not_specialize=["num_requests", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, order_ptr,
    k_scale_ptr, v_scale_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_requests,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    q_weight_ptr, k_weight_ptr, cos_sin_ptr, slot_ptr, k_inv_ptr, v_inv_ptr, stride_rope, q_eps, k_eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_ROWS: tl.constexpr, KV_TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PURE_DECODE: tl.constexpr, FUSED_MERGE: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_F16: tl.constexpr, DOT_PRECISION: tl.constexpr, SKIP_DECODES: tl.constexpr,
    TRIGGER: tl.constexpr, ORDERED: tl.constexpr, HEADS_FIRST: tl.constexpr, WAIT: tl.constexpr,
    FUSED_QK: tl.constexpr,
):
    # TRIGGER: the o projection after it may launch now (pdl_launch.pdl_triggers); WAIT: launched
    # with PDL, it waits for the kernel before it (the q/k norm + RoPE + store, or with FUSED_QK the qkv
    # projection) first (pdl_launch.pdl_waits). FUSED_QK (pure decode only): q_ptr is the raw packed
    # projection, whose q/k norm, RoPE and K/V store this launch does itself (decode_qk.py).
    pdl_start(TRIGGER, WAIT)
    tile, kv_head = _grid_ids(HEADS_FIRST)
    split = tl.program_id(2)

    if PURE_DECODE:  # one token per request: tile i is request i (or the i-th longest), its query token too
        request = tile
        if ORDERED:
            request = tl.load(order_ptr + tile)
        q_start = request
        q_len = 1
        q_tile = 0
    else:
        request = _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + request)
        q_len = tl.load(query_start_loc_ptr + request + 1) - q_start
        q_tile = tile - (q_start // BLOCK_Q + request)
        if q_tile * BLOCK_Q >= q_len:  # an unused tile index between two requests
            return
        if SKIP_DECODES and q_len == 1:  # the decode kernel's, in this step
            return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - q_len  # keys already in the cache before this step's tokens

    rows = tl.arange(0, TILE_ROWS)
    q_local = rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    q_index = q_tile * BLOCK_Q + q_local  # query token within the request
    row_valid = (q_local < BLOCK_Q) & (q_index < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = context_len + q_index  # its position: it sees keys 0..q_pos
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM

    token = (q_start + q_index).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    if not FUSED_QK:
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask,
                    other=0.0)
    if KV_FP8:  # scores and values come out in stored units: the scales apply once, outside the loop
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)

    # Keys this tile needs: up to the position of its last query token; then this split's slice.
    kv_end = tl.minimum(context_len + (q_tile + 1) * BLOCK_Q, seq_len)
    kv_per_split = tl.cdiv(tl.cdiv(kv_end, KV_TILE), NUM_SPLITS) * KV_TILE
    active = _active_splits(kv_end, kv_per_split, NUM_SPLITS, FUSED_MERGE)
    if split >= active:   # no keys in this split's slice, and nothing of it to merge
        return
    kv_lo = split * kv_per_split
    kv_hi = tl.minimum(kv_end, kv_lo + kv_per_split)
    if FUSED_QK:   # after the return above: a split without keys has no use for q
        q = decode_qk.norm_rope(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh,
                                dims[None, :] + rows[:, None] * 0, q_mask, q_weight_ptr,
                                cos_sin_ptr + token[:, None] * stride_rope, q_eps, 1, HEAD_DIM // 2)
        if decode_qk.owns_new_key(split, seq_len, kv_per_split):
            decode_qk.store_new_kv(q_ptr, request.to(tl.int64), kv_head, stride_qt, k_weight_ptr,
                                   cos_sin_ptr + request.to(tl.int64) * stride_rope, k_eps, slot_ptr, k_cache_ptr,
                                   v_cache_ptr, k_inv_ptr, v_inv_ptr, stride_cb, stride_cs, stride_ch, NUM_HEADS,
                                   NUM_KV_HEADS, HEAD_DIM, DIM_PAD, BLOCK_SIZE, KV_FP8)
    if DOT_F16:  # e4m3 -> f16 is one instruction per pair (-> bf16 costs one more per element)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -F16_MAX), F16_MAX).to(tl.float16)

    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined for rows that see no key.
    m_i = tl.full([TILE_ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([TILE_ROWS], tl.float32)
    acc = tl.zeros([TILE_ROWS, DIM_PAD], tl.float32)
    block_table = block_tables_ptr + request.to(tl.int64) * stride_bt
    for kv_start in range(kv_lo, kv_hi, KV_TILE):
        kv_pos, kv_valid, kv_offset, kv_mask = _kv_tile(block_table, kv_start, kv_hi, kv_head, dim_valid, stride_cb,
                                                        stride_cs, stride_ch, BLOCK_SIZE, KV_TILE)
        k = tl.load(k_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_scale = 1.0
    if KV_FP8:
        out_scale = tl.load(v_scale_ptr + kv_head)
    _write_result(acc, m_i, l_i, out_scale, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
                  token, head, row_valid, dims, dim_valid, request, kv_head, split, active, q_start.to(tl.int64),
                  stride_ot, stride_oh, NUM_HEADS, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, DIM_PAD, NUM_SPLITS,
                  FUSED_MERGE, MERGE_CHUNK)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: any small number exercises the same code paths
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_requests: int, num_kv_heads: int, device: torch.device, num_warps: int = 4) -> int:
    """Split-K factor for a decode launch of num_warps-warp programs: enough programs to fill the
    GPU. Depends only on the batch shape, never on context lengths, so a captured CUDA graph
    stays valid."""
    target = max(1, DECODE_WARPS_PER_SM // num_warps) * _multiprocessor_count(device)
    splits = 1
    while num_requests * num_kv_heads * splits < target and splits < MAX_DECODE_SPLITS:
        splits *= 2
    return splits


def _split_counters(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counters of the fused split merge, one per (request, kv head); each launch
    leaves them zero. Allocated once per device, at the first split launch (an eager warm-up's,
    before any CUDA-graph capture), and grown only when a launch needs more."""
    counters = _SPLIT_COUNTERS.get(device)
    if counters is None or counters.numel() < size:
        counters = torch.zeros(max(size, DECODE_WARPS_PER_SM * _multiprocessor_count(device)), dtype=torch.int32,
                               device=device)
        _SPLIT_COUNTERS[device] = counters
    return counters


_SPLIT_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _fp8_scales(k_cache: torch.Tensor, kv_scales: KVScales | None) -> KVScales | None:
    if not is_fp8(k_cache):
        return None
    if kv_scales is None:
        raise ValueError("an fp8 KV cache needs its layer's KVScales")
    return kv_scales


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v[token] for every slot >= 0
    (quantized with kv_scales for an FP8 cache)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    scales = _fp8_scales(k_cache, kv_scales)
    _store_kv_kernel[(triton.cdiv(num_tokens, STORE_TOKENS_PER_PROGRAM),)](
        k, v, k_cache, v_cache, slot_mapping,
        scales.k_inv if scales else slot_mapping, scales.v_inv if scales else slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=_pow2(num_kv_heads), DIM_PAD=_pow2(head_dim), TOKENS=STORE_TOKENS_PER_PROGRAM,
        KV_FP8=scales is not None,
    )


def decode_launch(kv_fp8: bool, num_requests: int) -> LaunchConfig:
    """The decode table's config for a batch of num_requests one-token requests (its grid kv heads
    first unless DECODE_HEADS_FIRST is off)."""
    table = DECODE_LAUNCHES
    if kv_fp8:
        table = DECODE_LAUNCHES_FP8_GQA if FP8_DECODE_KERNEL else DECODE_LAUNCHES_FP8
    return dataclasses.replace(_covering(table, num_requests), heads_first=DECODE_HEADS_FIRST)


def gqa_decode_launch(num_requests: int) -> LaunchConfig:
    """The decode kernel's config for num_requests one-token requests (a mixed batch's, apart)."""
    return _covering(DECODE_LAUNCHES_FP8_GQA, num_requests)


def _covering(table, num_requests: int) -> LaunchConfig:
    """The first config of a (largest batch or None, config) table that covers num_requests."""
    for max_batch, launch in table:
        if max_batch is None or num_requests <= max_batch:
            return launch
    raise ValueError(f"no decode launch config covers a batch of {num_requests}")


def prefill_launch(kv_fp8: bool) -> LaunchConfig:
    return PREFILL_LAUNCH_FP8 if kv_fp8 else PREFILL_LAUNCH


def mixed_decodes_apart(kv_fp8: bool) -> bool:
    return MIXED_DECODES_APART_FP8 if kv_fp8 else MIXED_DECODES_APART


def decode_variant_counts(num_kv_heads: int, max_requests: int, kv_fp8: bool,
                          device: torch.device) -> tuple[list[int], list[int]]:
    """The fewest requests of each decode-launch variant (its launch config and split-K factor,
    compile-time constants chosen by the number of requests) that steps of 1..max_requests
    requests reach: of pure-decode steps, and of mixed steps where their decodes go apart. One
    step at each compiles every variant. (An FP8 cache's mixed steps reach ~10; warming up only
    the full batch left them to compile on the first requests: v19's 7.7 s time to first token.)"""
    def firsts(launch_of: Callable[[int], LaunchConfig], ordered: Callable[[int], bool]) -> list[int]:
        seen, counts = set(), []
        for n in range(1, max_requests + 1):
            launch = launch_of(n)
            key = (launch, decode_num_splits(n, num_kv_heads, device, launch.num_warps), ordered(n))
            if key not in seen:
                seen.add(key)
                counts.append(n)
        return counts

    # Pure-decode steps that hand their programs out longest first (AttentionMetadata.decode_order):
    # another compile-time constant.
    pure = firsts(lambda n: decode_launch(kv_fp8, n), attention_base.longest_first)
    return pure, firsts(gqa_decode_launch, lambda n: False) if mixed_decodes_apart(kv_fp8) else []


@dataclass(frozen=True)
class _Step:
    """What every launch of one paged_attention call shares."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    scales: KVScales | None
    order: torch.Tensor | None = None   # pure decode: the requests longest first (AttentionMetadata.decode_order)
    qk: DecodeQK | None = None          # pure decode: q is the raw projection's, normed, rotated and stored here

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    def args(self, part_out: torch.Tensor, part_lse: torch.Tensor, counters: torch.Tensor) -> tuple:
        """The positional arguments both attention kernels take."""
        q, k_cache, out, scales = self.q, self.k_cache, self.out, self.scales
        return (q, k_cache, self.v_cache, out, part_out, part_lse, counters,
                self.order if self.order is not None else self.seq_lens,
                scales.k if scales else out, scales.v if scales else out,
                self.query_start_loc, self.seq_lens, self.block_tables,
                self.scale * LOG2_E, self.num_requests,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), self.block_tables.stride(0),
                *(self.qk.args(scales) if self.qk else decode_qk.placeholder_args(out)))

    def constants(self) -> dict:
        """The compile-time arguments both attention kernels take."""
        num_heads, head_dim = self.q.shape[1], self.q.shape[2]
        group = num_heads // self.num_kv_heads
        return dict(
            NUM_HEADS=num_heads, NUM_KV_HEADS=self.num_kv_heads, GROUP=group, GROUP_PAD=_pow2(group),
            HEAD_DIM=head_dim, DIM_PAD=self.dim_pad, BLOCK_SIZE=self.k_cache.shape[1], KV_FP8=self.scales is not None,
            # An FP8 cache under a 16-bit model multiplies in float16: e4m3 converts exactly, and so
            # does every bfloat16 q from 6e-5 to 65504 (smaller ones lose bits that cannot move a
            # score; larger ones saturate); e4m3 -> f16 is the cheap conversion. float32 models
            # (CPU-style tests, debugging) get exact products, not tf32.
            DOT_F16=self.scales is not None and self.q.dtype != torch.float32,
            DOT_PRECISION="ieee" if self.q.dtype == torch.float32 else "tf32", FUSED_QK=self.qk is not None)

    @property
    def dim_pad(self) -> int:
        return max(16, _pow2(self.q.shape[2]))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    scale: float, *, pure_decode: bool, num_splits: int | None = None, kv_scales: KVScales | None = None,
    launch: LaunchConfig | None = None, fused_merge: bool | None = None, decodes_apart: bool | None = None,
    decode_order: torch.Tensor | None = None, qk: DecodeQK | None = None,
) -> torch.Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged cache (see base.py).
    pure_decode: every request has exactly one query token (then num_tokens == batch).
    num_splits: split-K factor of the decode launch (by default chosen from the batch shape), or
    of a mixed batch's tile launch (by default 1). kv_scales: the layer's scales, for an FP8 cache.
    launch, fused_merge, decodes_apart: override the tables (decode_launch, prefill_launch,
    FUSED_SPLIT_MERGE, mixed_decodes_apart), for benchmarks and tests; in a mixed batch `launch`
    is the tile launch's. decode_order: a pure-decode step's requests in the order its programs
    should start, longest context first (AttentionMetadata.decode_order): the launch's last wave
    then holds short contexts instead of a few long ones that end it alone. qk (pure decode only): q is
    the packed projection's q part as it left the projection, and the launch does the q/k norm, RoPE
    and the step's K/V store itself (decode_qk.py)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.dtype == v_cache.dtype
    if qk is not None:
        assert pure_decode, "only a pure-decode launch takes the raw projection"
        qk.check(q, k_cache.shape[2])
    step = _Step(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                 _fp8_scales(k_cache, kv_scales), decode_order if pure_decode else None, qk)
    fp8 = step.scales is not None
    fused_merge = FUSED_SPLIT_MERGE if fused_merge is None else fused_merge
    if pure_decode:
        assert q.shape[0] == step.num_requests
        _launch_decodes(step, launch or decode_launch(fp8, step.num_requests), num_splits, fused_merge,
                        pure_decode=True)
        return out
    apart = mixed_decodes_apart(fp8) if decodes_apart is None else decodes_apart
    # Merging a split tile launch over every token would overwrite the decode launch's outputs.
    assert not (apart and num_splits and num_splits > 1), "a mixed batch's decodes apart: its tile launch is unsplit"
    if apart:
        _launch_decodes(step, gqa_decode_launch(step.num_requests), None, fused_merge, pure_decode=False)
    _launch_tiles(step, launch or prefill_launch(fp8), num_splits or 1, False, pure_decode=False,
                  skip_decodes=apart)
    return out


def _launch_decodes(step: _Step, launch: LaunchConfig, num_splits: int | None, fused_merge: bool, *,
                    pure_decode: bool) -> None:
    """The one-token requests of the step (all of them when pure_decode)."""
    if num_splits is None:
        num_splits = decode_num_splits(step.num_requests, step.num_kv_heads, step.q.device, launch.num_warps)
    if launch.kernel == TILES:
        assert pure_decode, "the tile kernel takes a mixed batch's decodes in its own launch"
        _launch_tiles(step, launch, num_splits, fused_merge, pure_decode=True, skip_decodes=False)
        return
    assert launch.kernel in (GQA, GQA_FMA), f"unknown attention kernel {launch.kernel!r}"
    use_dot = launch.kernel == GQA
    buffers = _split_buffers(step, num_splits, fused_merge)
    constants = step.constants()
    heads_first = _heads_first(launch, step.num_requests)
    _paged_decode_kernel[_grid(step.num_requests, step.num_kv_heads, num_splits, heads_first)](
        *step.args(*buffers), **constants, USE_DOT=use_dot, HEADS_FIRST=heads_first,
        COLS=max(MIN_DECODE_COLS if use_dot else 1, constants["GROUP_PAD"]), KV_TILE=launch.kv_tile,
        NUM_SPLITS=num_splits,
        PURE_DECODE=pure_decode, FUSED_MERGE=fused_merge, MERGE_CHUNK=_merge_chunk(step, num_splits),
        ORDERED=step.order is not None, **_pdl(step, num_splits, fused_merge),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    _merge_apart(step, buffers, num_splits, fused_merge, one_token_requests=not pure_decode)


def _launch_tiles(step: _Step, launch: LaunchConfig, num_splits: int, fused_merge: bool, *, pure_decode: bool,
                  skip_decodes: bool) -> None:
    """The tile kernel over the step's requests (but its one-token ones when skip_decodes)."""
    assert launch.kernel == TILES, f"{launch.kernel!r} takes one-token requests only"
    assert num_splits == _pow2(num_splits), "num_splits must be a power of two"
    num_tokens = step.q.shape[0]
    constants = step.constants()
    group_pad = constants["GROUP_PAD"]
    if pure_decode:
        block_q, num_tiles = 1, step.num_requests
    else:
        block_q = max(1, launch.tile_rows // group_pad)
        num_tiles = num_tokens // block_q + step.num_requests  # upper bound, see _find_request
    # The merge counts splits per (request, kv head): one query tile per request, so decode only.
    fused_merge = fused_merge and pure_decode
    buffers = _split_buffers(step, num_splits, fused_merge)
    heads_first = pure_decode and _heads_first(launch, num_tiles)
    _paged_attention_kernel[_grid(num_tiles, step.num_kv_heads, num_splits, heads_first)](
        *step.args(*buffers), **constants,
        BLOCK_Q=block_q, TILE_ROWS=max(16, launch.tile_rows, block_q * group_pad), KV_TILE=launch.kv_tile,
        NUM_SPLITS=num_splits, PURE_DECODE=pure_decode, FUSED_MERGE=fused_merge,
        MERGE_CHUNK=_merge_chunk(step, num_splits), SKIP_DECODES=skip_decodes,
        ORDERED=pure_decode and step.order is not None, HEADS_FIRST=heads_first, **_pdl(step, num_splits, fused_merge),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    _merge_apart(step, buffers, num_splits, fused_merge, one_token_requests=False)


# A CUDA grid's second axis holds at most this many programs (its first: 2**31 - 1).
MAX_GRID_Y = 65535


def _heads_first(launch: LaunchConfig, num_tiles: int) -> bool:
    """Whether a launch of num_tiles query tiles orders its grid kv heads first: as its config says,
    unless the tiles would not fit the grid's second axis."""
    return launch.heads_first and num_tiles <= MAX_GRID_Y


def _grid(num_tiles: int, num_kv_heads: int, num_splits: int, heads_first: bool) -> tuple[int, int, int]:
    """The attention kernels' grid: (query tiles, kv heads, splits), the first two swapped for
    heads_first (_grid_ids reads them back)."""
    if heads_first:
        return num_kv_heads, num_tiles, num_splits
    return num_tiles, num_kv_heads, num_splits


def _pdl(step: _Step, num_splits: int, fused_merge: bool) -> dict:
    """An attention launch's PDL arguments (pdl_launch.pdl_chain_args): launched as a link of the
    decode layer's chain, it waits for the kernel before it; and it lets the kernel after it launch
    at its start (as the norms do for the projections), so the o projection, GEMV or FP8 GEMM launched
    with PDL, asks for its first weights while attention runs and waits for its end before reading
    the output. Where a separate merge launch follows, only when that merge is in the chain too (it
    then triggers the o projection)."""
    args = pdl_launch.pdl_chain_args(step.q.device)
    args["TRIGGER"] = args["TRIGGER"] and (num_splits == 1 or fused_merge or args["WAIT"])
    return args


def _split_buffers(step: _Step, num_splits: int, fused_merge: bool) -> tuple[torch.Tensor, ...]:
    """(partial outputs, their log-sum-exps, merge counters); the output stands in for those a
    launch does not use."""
    if num_splits == 1:
        return step.out, step.out, step.out
    num_tokens, num_heads, head_dim = step.q.shape
    device = step.q.device
    part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    counters = _split_counters(device, step.num_requests * step.num_kv_heads) if fused_merge else step.out
    return part_out, part_lse, counters


def _merge_chunk(step: _Step, num_splits: int) -> int:
    group_pad = _pow2(step.q.shape[1] // step.num_kv_heads)
    return min(num_splits, max(1, MERGE_ELEMENTS // (group_pad * step.dim_pad)))


def _merge_apart(step: _Step, buffers: tuple[torch.Tensor, ...], num_splits: int, fused_merge: bool, *,
                 one_token_requests: bool) -> None:
    """The merge launch of a split launch whose last splits did not merge."""
    if num_splits == 1 or fused_merge:
        return
    part_out, part_lse, _ = buffers
    rows = step.num_requests if one_token_requests else step.q.shape[0]
    _merge_splits_kernel[(rows, step.q.shape[1])](
        part_out, part_lse, step.out, step.query_start_loc, step.out.stride(0), step.out.stride(1),
        NUM_HEADS=step.q.shape[1], HEAD_DIM=step.q.shape[2], DIM_PAD=step.dim_pad, NUM_SPLITS=num_splits,
        ONE_TOKEN_REQUESTS=one_token_requests, **pdl_launch.pdl_chain_args(step.q.device),
    )
