"""Few-row linear layers (decode steps): y = x @ W^T (+ bias) by a Triton GEMV / split-K kernel.

At a decode step a projection multiplies a handful of rows by the whole weight, so it is a
read of the weight and nothing else; this kernel is written for that read. One program owns
BLOCK_N output columns of BLOCK_M rows and one of `split_k` slices of K, streams its weight
tile by tile and accumulates in float32:
- rows < 16: CUDA-core FMAs into a [BLOCK_M, BLOCK_N, BLOCK_K] accumulator, reduced over K
  once after the loop (no shuffles inside it); or, with `row_acc` (up to 4 rows), one
  [BLOCK_N, BLOCK_K] accumulator per row, the loop pipelined by tl.range num_stages deep;
- rows >= 16: tensor-core dots of [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles.
With split_k > 1 each program writes its partial tile to a float32 workspace and counts itself
in a per-tile counter; the last of a tile's programs sums the partials in split order,
`split_chunk` of them per load (so the result is deterministic), writes the output and resets
the counter to 0. One launch, no host sync, sizes fixed by the row count: capturable in CUDA
graphs. The counters are shared by every call on a device, so calls must not run concurrently
on two streams.

Options, each a compile-time switch:
- FP8 weights (float8_e4m3fn with one float32 scale per GROUP_N x GROUP_K block, fp8.py) with
  bf16 activations (weight-only: no activation quantization). A tile lies in one row of scale
  blocks; the FMA loop scales x by each column's block scale, the tensor-core loop scales each
  tile's product (its K tile then lies in one scale block). With `fp8_bits` the loops take each
  weight as a float32 (CUDA cores) or bfloat16 (tensor cores) by moving its bits, with no
  conversion instruction (the tensor-core loop otherwise converts every element f16 -> bf16 on
  the 16-lane conversion pipe; on CUDA cores the packed conversion costs fewer instructions than
  the move: PERF_NOTES v38): the weight comes out 2^-120 of its value, the activation is scaled
  by 2^64 and the sums by 2^56, all exact powers of two, so the product is the same;
- SILU_MUL: x is [gate | up] (2K wide) and the kernel multiplies silu(gate) * up, rounded to
  x's dtype exactly as fused_kernels.silu_and_mul rounds it, so the down projection needs no
  separate activation kernel;
- NORM (`gemv(..., norm=FoldedNorm)`): the RMSNorm before the layer folded in, its launch gone:
  each program first sums its rows' squares over the whole of K (of x + residual, the sum rounded
  to x's dtype as fused_kernels.rms_norm rounds it), then normalises each activation tile as it
  loads it; the programs of column tile 0 store x + residual over their K slices, so the new
  residual is written once. Not with SILU_MUL or `row_acc`;
- a bias, added in float32 before the single rounding to x's dtype;
- PDL (programmatic dependent launch): the first weight tile is loaded before waiting for the
  previous kernel (weights never depend on it; with one K tile a program, `whole_slice`, that is
  the program's whole slice, read while the kernels before it run), and the next kernel may launch at once
  (`pdl_launch.pdl_in_graphs` says whether CUDA graphs replay this here); with `prefetch`, the first
  K tiles of the program's weight rows are asked into L2 (sm90's bulk prefetch) before that wait.
  With `late_trigger` the next kernel may launch only once this one's loop is done (before its
  stores and split-K sums), so its programs ask for their weights during this one's tail
  instead of taking SM slots and bandwidth from the whole of its loop.
Under TRITON_INTERPRET=1 the kernel runs on the CPU for the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from worker_svc.layers import pdl_launch
from worker_svc.layers.triton_compile import launch

# Split-K tile counters per device; a launch may use this many (output tiles of one call).
MAX_SPLIT_TILES = 1 << 14
DOT_MIN_ROWS = 16   # tl.dot needs 16-row tiles: fewer rows use the FMA loop
WGMMA_MIN_ROWS = 64   # row tiles from which Triton runs a Hopper dot on wgmma (below: mma.sync, warps split N)
ROW_ACC_MAX_ROWS = 4   # rows the per-row-accumulator FMA loop holds

_counters: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = False   # programmatic dependent launch: weights are read while the previous kernel ends
    row_acc: bool = False   # FMA rows: one accumulator per row, the loop pipelined num_stages deep
    prefetch: int = 0       # with pdl: K tiles of weights asked into L2 before waiting for the previous kernel
    split_chunk: int = 1    # split-K partials the tile's last program sums per load
    fp8_bits: bool = False  # FP8 weights as float32 / bfloat16 by moving bits, not by conversion
    late_trigger: bool = False  # with pdl: the next kernel may launch once this one's loop is done, not at its start
    early_dot: bool = False     # tensor-core tiles: the first weight tile loaded before the PDL wait (as the FMA loop's)

    @property
    def use_dot(self) -> bool:
        return self.block_m >= DOT_MIN_ROWS

    def __str__(self) -> str:
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}{' pdl' if self.pdl else ''}{' rows' if self.row_acc else ''}"
                f"{prefetch_label(self.prefetch)}"
                f"{f' chunk{self.split_chunk}' if self.split_chunk > 1 else ''}{' bits' if self.fp8_bits else ''}"
                f"{' late' if self.late_trigger else ''}{' early' if self.early_dot else ''}")


def prefetch_label(tiles: int) -> str:
    """How a launch's name shows its L2 prefetch: ' pf2' (K tiles), or ''."""
    return f" pf{tiles}" if tiles else ""


@triton.jit
def _load_x(x_ptrs, mask, K, SILU_MUL: tl.constexpr, dtype: tl.constexpr):
    """An activation tile: x, or silu(gate) * up for the gate tile at x_ptrs (up lies K columns
    later), rounded as fused_kernels.silu_and_mul rounds it."""
    return _load_act(x_ptrs, x_ptrs, x_ptrs, 0.0, mask, K, SILU_MUL, False, False, dtype, False)


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in float32, silu rounded to dtype first as F.silu rounds its output (the caller
    rounds the product): SwiGLU's one formula, for fused_kernels' SwiGLU kernels and every GEMM or GEMV
    that folds it in, so they round alike."""
    gate = gate.to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return activated * up.to(tl.float32)


@triton.jit
def _layout_fence(x):
    """x (float32) through an opaque move: Triton's dot-operand pass does not hoist the operand's
    layout above it (see _load_act's SILU_FENCE). GPU only: the interpreter runs no PTX."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _load_act(x_ptrs, r_ptrs, nw_ptrs, rstd, mask, K, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
              NORM_RESIDUAL: tl.constexpr, dtype: tl.constexpr, SILU_FENCE: tl.constexpr):
    """_load_x's tile, or with NORM the RMSNorm of x (+ the residual at r_ptrs, the sum rounded
    first) by each row's inverse RMS `rstd` and the norm's weight at nw_ptrs, rounded as
    fused_kernels.rms_norm rounds it. SILU_FENCE (a tensor-core dot's operand, on a GPU): SwiGLU's
    product passes _layout_fence, so Triton computes it in the loads' layout, each element once, and
    converts the result for the dot; otherwise it moves the dot operand's layout above the arithmetic,
    where each of the program's warps holds (and computes) the whole tile: 1,044 instructions a K tile
    against 406 at 16 rows, 1,087 against 763 at 32 (4x and 2x the MUFU). Not from WGMMA_MIN_ROWS rows,
    where Hopper's wgmma gives each warp its own rows of the operand: there it cost 1,181 -> 1,514
    (sm_90 SASS read here; PERF_NOTES v50)."""
    if NORM:
        t = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        if NORM_RESIDUAL:
            t = (t + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        weight = tl.load(nw_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = ((t * rstd[:, None]).to(dtype).to(tl.float32) * weight).to(dtype)
    elif SILU_MUL:
        gate = tl.load(x_ptrs, mask=mask, other=0.0)
        up = tl.load(x_ptrs + K, mask=mask, other=0.0)
        product = silu_times(gate, up, dtype)
        if SILU_FENCE:
            product = _layout_fence(product)
        x = product.to(dtype)
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0)
    return x


# Weights taken by their bits (fp8_bits) come out 2^-120 of their values; the activation is scaled
# by BITS_X_SCALE and the sums by BITS_SUM_SCALE, exact powers of two, so the product is the same.
BITS_X_SCALE = tl.constexpr(2.0 ** 64)
BITS_SUM_SCALE = tl.constexpr(2.0 ** 56)   # 2^64 * 2^-120 undone


@triton.jit
def _fp8_bits_as_f32(w):
    """e4m3 weights as float32 times 2^-120, by moving bits: the sign to bit 31, exponent and
    mantissa to bits 20-26 (float32's exponent bias is 127, e4m3's 7). Exact for every finite
    e4m3 value, zero and subnormals included (they land on float32 subnormals)."""
    b = w.to(tl.uint8, bitcast=True).to(tl.uint32)
    return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def fp8_bits_as_bf16(w):
    """e4m3 weights as bfloat16 times 2^-120, by moving bits (bfloat16 is float32's upper half):
    exact for every finite e4m3 value, subnormals landing on bfloat16 subnormals."""
    b = w.to(tl.uint8, bitcast=True).to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp8_weight_f32(w, FP8_BITS: tl.constexpr):
    """A weight tile as float32: converted, or (FP8_BITS) its bits moved (2^-120 of its value)."""
    if FP8_BITS:
        return _fp8_bits_as_f32(w)
    return w.to(tl.float32)


@triton.jit
def _tile_mask(rows_mask, k, k_end, offs_k, EVEN_K: tl.constexpr):
    """Which elements of the tile of these rows at column k lie before k_end (with whole tiles,
    a mask uniform along K, which keeps loads vectorized)."""
    if EVEN_K:
        mask = rows_mask[:, None] & (k < k_end)
    else:
        mask = rows_mask[:, None] & ((k + offs_k) < k_end)[None, :]
    return mask


@triton.jit
def _fma_loop(x_ptrs, w_ptrs, w, w_scale_row, m_mask, n_mask, offs_k, k_begin, k_end, K,
              GROUP_K: tl.constexpr, FP8: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              dtype: tl.constexpr, FP8_BITS: tl.constexpr, r_ptrs, nw_ptrs, rstd, NORM: tl.constexpr,
              NORM_RESIDUAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32 sums over this program's K range, on CUDA cores, from its first
    weight tile `w` (at w_ptrs; the kernel loads it before waiting for the previous kernel: weights
    never depend on it). The next weight tile is loaded before the current one is used (two tiles
    in flight)."""
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        w_ptrs += BLOCK_K
        w_next = tl.load(w_ptrs, mask=_tile_mask(n_mask, k + BLOCK_K, k_end, offs_k, EVEN_K), other=0.0)
        x = _load_act(x_ptrs, r_ptrs, nw_ptrs, rstd, _tile_mask(m_mask, k, k_end, offs_k, EVEN_K), K, SILU_MUL, NORM,
                      NORM_RESIDUAL, dtype, False).to(tl.float32)
        if FP8:   # scaling x (BLOCK_M rows) costs less than scaling the tile (BLOCK_N rows)
            scale = tl.load(w_scale_row + (k + offs_k) // GROUP_K, mask=(k + offs_k) < k_end, other=0.0)
            if FP8_BITS:
                scale = scale * BITS_X_SCALE
            x = x * scale[None, :]
        acc3 += x[:, None, :] * _fp8_weight_f32(w, FP8_BITS)[None, :, :]
        w = w_next
        x_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
        nw_ptrs += BLOCK_K
    acc = tl.sum(acc3, axis=2)
    if FP8_BITS:
        acc = acc * BITS_SUM_SCALE
    return acc


@triton.jit
def _fma_row(x_ptrs, row_ok, k, k_end, offs_k, scale, K, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
             dtype: tl.constexpr):
    """One row of the activation tile at column k, in float32, times the weight's scales."""
    if EVEN_K:
        mask = row_ok & (k < k_end)
    else:
        mask = row_ok & ((k + offs_k) < k_end)
    return _load_x(x_ptrs, mask, K, SILU_MUL, dtype).to(tl.float32) * scale


@triton.jit
def _fma_rows_loop(x_ptrs, stride_xm, w_ptrs, w_scale_row, row0, M, n_mask, offs_k, k_begin, k_end, K,
                   GROUP_K: tl.constexpr, FP8: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                   dtype: tl.constexpr, FP8_BITS: tl.constexpr):
    """The FMA loop's sums (ROW_ACC) for up to ROW_ACC_MAX_ROWS rows from x_ptrs, row0's row: each
    row keeps a [BLOCK_N, BLOCK_K] accumulator in the weight tile's own layout (no data moves
    between threads inside the loop), reduced over K once after it. tl.range pipelines the loop:
    NUM_STAGES - 1 tiles of weights, activations and scales in flight."""
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = _fp8_weight_f32(tl.load(w_ptrs, mask=_tile_mask(n_mask, k, k_end, offs_k, EVEN_K), other=0.0), FP8_BITS)
        if FP8:   # one scale per column's block: scaling x (a row) costs less than scaling w (a tile)
            scale = tl.load(w_scale_row + (k + offs_k) // GROUP_K, mask=(k + offs_k) < k_end, other=0.0)
            if FP8_BITS:
                scale = scale * BITS_X_SCALE
        else:
            scale = 1.0
        acc0 += _fma_row(x_ptrs, row0 < M, k, k_end, offs_k, scale, K, SILU_MUL, EVEN_K, dtype)[None, :] * w
        if BLOCK_M > 1:
            acc1 += _fma_row(x_ptrs + stride_xm, row0 + 1 < M, k, k_end, offs_k, scale, K, SILU_MUL, EVEN_K,
                             dtype)[None, :] * w
        if BLOCK_M > 2:
            acc2 += _fma_row(x_ptrs + 2 * stride_xm, row0 + 2 < M, k, k_end, offs_k, scale, K, SILU_MUL, EVEN_K,
                             dtype)[None, :] * w
            acc3 += _fma_row(x_ptrs + 3 * stride_xm, row0 + 3 < M, k, k_end, offs_k, scale, K, SILU_MUL, EVEN_K,
                             dtype)[None, :] * w
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    rows = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.where(rows == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if BLOCK_M > 1:
        acc = tl.where(rows == 1, tl.sum(acc1, axis=1)[None, :], acc)
    if BLOCK_M > 2:
        acc = tl.where(rows == 2, tl.sum(acc2, axis=1)[None, :], acc)
        acc = tl.where(rows == 3, tl.sum(acc3, axis=1)[None, :], acc)
    if FP8_BITS:
        acc = acc * BITS_SUM_SCALE
    return acc


@triton.jit
def _dot_tile(x, w, w_scale_row, k, GROUP_K: tl.constexpr, FP8: tl.constexpr, dtype: tl.constexpr,
              FP8_BITS: tl.constexpr):
    """One K tile's float32 product on tensor cores. With FP8_BITS (bfloat16 activations) the weights
    enter the dot as fp8_bits_as_bf16 gives them and the activations times 2^64, so the product is
    2^-56 of the converted one, undone here."""
    if FP8_BITS:
        scaled = (x.to(tl.float32) * BITS_X_SCALE).to(tl.bfloat16)   # exact
        product = tl.dot(scaled, tl.trans(fp8_bits_as_bf16(w)))
    else:
        product = tl.dot(x, tl.trans(w.to(dtype)))
    if FP8:   # the K tile lies in one scale block (GROUP_K is a multiple of BLOCK_K)
        scale = tl.load(w_scale_row + k // GROUP_K)
        if FP8_BITS:
            scale = scale * BITS_SUM_SCALE
        product = product * scale
    return product


@triton.jit
def _dot_loop(acc, x_ptrs, w_ptrs, w_scale_row, m_mask, n_mask, offs_k, k_begin, k_end, K,
              GROUP_K: tl.constexpr, FP8: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_K: tl.constexpr, dtype: tl.constexpr, FP8_BITS: tl.constexpr, r_ptrs, nw_ptrs, rstd,
              NORM: tl.constexpr, NORM_RESIDUAL: tl.constexpr, SILU_FENCE: tl.constexpr):
    """The same sums on tensor cores, added to `acc` (Triton pipelines the loads through shared memory)."""
    for k in range(k_begin, k_end, BLOCK_K):
        x = _load_act(x_ptrs, r_ptrs, nw_ptrs, rstd, _tile_mask(m_mask, k, k_end, offs_k, EVEN_K), K, SILU_MUL, NORM,
                      NORM_RESIDUAL, dtype, SILU_FENCE)
        w = tl.load(w_ptrs, mask=_tile_mask(n_mask, k, k_end, offs_k, EVEN_K), other=0.0)
        acc += _dot_tile(x, w, w_scale_row, k, GROUP_K, FP8, dtype, FP8_BITS)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
        nw_ptrs += BLOCK_K
    return acc


@triton.jit
def _rms_of_rows(x_ptr, res_ptr, res_out_ptr, offs_m, m_mask, offs_k, K, k_begin, k_end, writes_residual, stride_xm,
                 eps, NORM_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Each row's inverse RMS over the whole of K (of x + residual, the sum rounded to the model
    dtype as the norm kernel rounds it); a program of column tile 0 (writes_residual) also stores
    the sum over its own K slice, so the program tiles of column 0 store the new residual once."""
    rows = offs_m.to(tl.int64)[:, None] * stride_xm
    squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + offs_k
        mask = m_mask[:, None] & (cols < K)[None, :]
        t = tl.load(x_ptr + rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if NORM_RESIDUAL:
            total = (t + tl.load(res_ptr + rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)).to(dtype)
            mine = mask & writes_residual & (cols >= k_begin)[None, :] & (cols < k_end)[None, :]
            tl.store(res_out_ptr + rows + cols[None, :], total, mask=mine)
            t = total.to(tl.float32)
        squares += t * t
    return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit
def prefetch_rows_l2(row_ptrs, num_bytes):
    """Asks L2 for num_bytes from each row pointer (sm90's bulk prefetch: a hint, nothing waits)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [row_ptrs, num_bytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M", "split_k", "tiles_per_split", "eps"])
def _gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, res_ptr, nw_ptr, res_out_ptr,
    M, N, K, split_k, tiles_per_split, eps,
    stride_xm, stride_wn, stride_wsn, stride_om,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, FP8: tl.constexpr, SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, PDL: tl.constexpr,
    ROW_ACC: tl.constexpr, PREFETCH_TILES: tl.constexpr, SPLIT_CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_BITS: tl.constexpr,
    LATE_TRIGGER: tl.constexpr, NORM: tl.constexpr, NORM_RESIDUAL: tl.constexpr, DOT_EARLY: tl.constexpr,
    SILU_FENCE: tl.constexpr,
):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL and not LATE_TRIGGER:   # a dependent launch may start now: it reads nothing of ours before its gdc_wait
        gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_begin = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + tiles_per_split * BLOCK_K, K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_begin + offs_k)[None, :]
    # An FP8 tile lies in one row of scale blocks (GROUP_N is a multiple of BLOCK_N).
    w_scale_row = w_scale_ptr + (pid_n * BLOCK_N // GROUP_N) * stride_wsn
    if PDL and PREFETCH_TILES > 0:   # weights never depend on the previous kernel: start their read now
        rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn + k_begin
        element_bytes: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        span = tl.minimum(k_end - k_begin, PREFETCH_TILES * BLOCK_K) * element_bytes
        prefetch_rows_l2(rows, tl.full((BLOCK_N,), 0, tl.int32) + span)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_begin + offs_k)[None, :]
    r_ptrs = res_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_begin + offs_k)[None, :]
    nw_ptrs = nw_ptr + (k_begin + offs_k)[None, :] + 0 * offs_m[:, None]
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    FMA: tl.constexpr = not USE_DOT and not ROW_ACC
    if FMA or DOT_EARLY:   # its first weight tile before the wait (with one K tile a program: its whole slice,
        # see whole_slice); then the previous kernel's end, then the activations
        w_first = tl.load(w_ptrs, mask=_tile_mask(n_mask, k_begin, k_end, offs_k, EVEN_K), other=0.0)
    if PDL:   # every read below depends on the previous kernel
        gdc_wait()
    if NORM:   # the RMSNorm before this projection, folded in: each row's inverse RMS over the whole of K
        rstd = _rms_of_rows(x_ptr, res_ptr, res_out_ptr, offs_m, m_mask, offs_k, K, k_begin, k_end, pid_n == 0,
                            stride_xm, eps, NORM_RESIDUAL, BLOCK_M, BLOCK_K, dtype)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_loop = k_begin
        if DOT_EARLY:   # the first tile's product from the weights loaded before the wait, then the loop
            x = _load_act(x_ptrs, r_ptrs, nw_ptrs, rstd, _tile_mask(m_mask, k_begin, k_end, offs_k, EVEN_K), K,
                          SILU_MUL, NORM, NORM_RESIDUAL, dtype, SILU_FENCE)
            acc += _dot_tile(x, w_first, w_scale_row, k_begin, GROUP_K, FP8, dtype, FP8_BITS)
            k_loop += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        acc = _dot_loop(acc, x_ptrs, w_ptrs, w_scale_row, m_mask, n_mask, offs_k, k_loop, k_end, K, GROUP_K, FP8,
                        SILU_MUL, EVEN_K, BLOCK_K, dtype, FP8_BITS, r_ptrs, nw_ptrs, rstd, NORM, NORM_RESIDUAL,
                        SILU_FENCE)
    elif ROW_ACC:   # (never with NORM: check_config)
        row_ptrs = x_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_xm + k_begin + offs_k
        acc = _fma_rows_loop(row_ptrs, stride_xm, w_ptrs, w_scale_row, pid_m * BLOCK_M, M, n_mask, offs_k, k_begin,
                             k_end, K, GROUP_K, FP8, SILU_MUL, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, dtype,
                             FP8_BITS)
    else:
        acc = _fma_loop(x_ptrs, w_ptrs, w_first, w_scale_row, m_mask, n_mask, offs_k, k_begin, k_end, K, GROUP_K,
                        FP8, SILU_MUL, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, dtype, FP8_BITS, r_ptrs, nw_ptrs, rstd,
                        NORM, NORM_RESIDUAL)

    if PDL and LATE_TRIGGER:   # the loop is done: the next kernel may launch (its wait still waits for our end)
        gdc_launch_dependents()
    out_mask = m_mask[:, None] & n_mask[None, :]
    finish_split_k(acc, partial_ptr, counter_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, M, N, offs_m,
                   offs_n, n_mask, out_mask, bias_ptr, out_ptr, stride_om, HAS_BIAS, SPLIT_CHUNK)


@triton.jit
def finish_split_k(acc, partial_ptr, counter_ptr, tile, pid_k, split_k, M, N, offs_m, offs_n, n_mask, out_mask,
                   bias_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """The output tile from this program's float32 sums `acc` (rows offs_m, columns offs_n), plus
    the bias, rounded once to the output's dtype. With split_k > 1 `acc` is slice pid_k's partial:
    written to the float32 workspace [split_k, M, N], the tile counted in, and the tile's last
    program to arrive sums the partials in split order, SPLIT_CHUNK per load (deterministic),
    stores the tile and resets its counter to 0. Shared by fp8_kernels' block-FP8 GEMM."""
    if split_k > 1:
        tile_partial = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k.to(tl.int64) * M * N + tile_partial, acc, mask=out_mask)
        tl.debug_barrier()   # every thread's partial is written before the tile is counted
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            acc = tl.zeros_like(acc)
            if SPLIT_CHUNK == 1:
                for s in range(0, split_k):
                    acc += tl.load(partial_ptr + s * M * N + tile_partial, mask=out_mask, other=0.0,
                                   cache_modifier=".cg")
            else:
                offs_s = tl.arange(0, SPLIT_CHUNK)
                for s in range(0, split_k, SPLIT_CHUNK):
                    chunk = (s + offs_s).to(tl.int64)[:, None, None] * M * N + tile_partial[None, :, :]
                    chunk_mask = ((s + offs_s) < split_k)[:, None, None] & out_mask[None, :, :]
                    acc += tl.sum(tl.load(partial_ptr + chunk, mask=chunk_mask, other=0.0, cache_modifier=".cg"),
                                  axis=0)
            _store_output(acc, bias_ptr, out_ptr, offs_m, offs_n, n_mask, out_mask, stride_om, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0)
    else:
        _store_output(acc, bias_ptr, out_ptr, offs_m, offs_n, n_mask, out_mask, stride_om, HAS_BIAS)


@triton.jit
def _store_output(acc, bias_ptr, out_ptr, offs_m, offs_n, n_mask, out_mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def split_slices(units: int, split: int) -> tuple[int, int]:
    """(units per slice, slices) of K's `units` (tiles or groups) split about `split` ways: every
    slice has units, so the count may come out below `split`."""
    per_slice = triton.cdiv(units, max(1, min(split, units)))
    return per_slice, triton.cdiv(units, per_slice)


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's tile counters: zeros, left at zero by every launch (of this module's GEMV and
    of fp8_kernels' split-K GEMM). Allocated by the first eager call, never during a CUDA-graph
    capture."""
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv's split-K counters must be allocated before a CUDA-graph capture "
                               "(run the layer once eagerly first)")
        counters = _counters[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counters


def whole_slice(config: GemvConfig, width: int) -> bool:
    """Whether each program of this launch reads its whole slice of a width-column weight before its
    PDL wait: the FMA loop, or the tensor-core loop with `early_dot` (early trigger), with one K tile a
    program, loaded ahead of the wait. Its weights then stream while the kernels before it in the decode
    layer's chain run, and after the wait it only reads its activations and sums (PERF_NOTES v46, v50)."""
    return (config.pdl and not config.late_trigger and (config.early_dot or not config.use_dot) and not config.row_acc
            and split_slices(triton.cdiv(width, config.block_k), config.split_k)[0] == 1)


def check_config(config: GemvConfig, num_cols: int, width: int, *, fp8_block: tuple[int, int] | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
    """Raises ValueError when `config` cannot run a [num_cols, width] weight."""
    if config.use_dot and (config.block_n < 16 or config.block_k < 16 or dtype == torch.float32):
        raise ValueError(f"gemv {config}: tensor-core tiles need 16-bit activations and 16-wide N and K tiles")
    if config.row_acc and (config.use_dot or config.block_m > ROW_ACC_MAX_ROWS):
        raise ValueError(f"gemv {config}: one accumulator per row is for CUDA-core tiles of <= {ROW_ACC_MAX_ROWS} rows")
    if config.early_dot and not config.use_dot:
        raise ValueError(f"gemv {config}: early_dot is the tensor-core loop's (the FMA loop always loads early)")
    if config.late_trigger and not config.pdl:
        raise ValueError(f"gemv {config}: a late trigger is a PDL launch's")
    if config.split_chunk & (config.split_chunk - 1) or config.split_chunk < 1:
        raise ValueError(f"gemv {config}: split_chunk must be a power of two")
    if config.prefetch and width % 16:
        raise ValueError(f"gemv {config}: L2 prefetches need rows of whole 16-byte units ({width} columns)")
    if config.split_k > 1 and triton.cdiv(num_cols, config.block_n) > MAX_SPLIT_TILES:
        raise ValueError(f"gemv {config}: {num_cols} columns are more split-K tiles than {MAX_SPLIT_TILES}")
    if config.fp8_bits and (fp8_block is None or (config.use_dot and dtype != torch.bfloat16)):
        raise ValueError(f"gemv {config}: moving bits is for FP8 weights (with bfloat16 activations on tensor cores)")
    if fp8_block is not None:
        bn, bk = fp8_block
        if bn % config.block_n:
            raise ValueError(f"gemv {config}: N tiles must divide the FP8 weight's {bn}-row blocks")
        if config.use_dot and bk % config.block_k:
            raise ValueError(f"gemv {config}: tensor-core K tiles must divide the FP8 weight's {bk}-column blocks")


@dataclass(frozen=True)
class FoldedNorm:
    """The RMSNorm a GEMV applies to its input first (`gemv(..., norm=)`): norm(x + residual)
    with the residual (or norm(x) without one), as fused_kernels.rms_norm computes it."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    out_residual: torch.Tensor | None = None   # where x + residual goes (else a new tensor)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, *, bias: torch.Tensor | None = None,
         weight_scale: torch.Tensor | None = None, fp8_block: tuple[int, int] | None = None,
         silu_mul: bool = False, norm: FoldedNorm | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """F.linear(a, W, bias) in x's dtype, where a = x, or silu(gate) * up for x = [gate | up]
    with `silu_mul`, or the RMSNorm `norm` of x (then, with its residual, returns (the product,
    x + residual): the next residual, as fused_kernels.rms_norm returns it); W = weight, or, for
    an FP8 weight, its values times `weight_scale` [ceil(N / bn), K / bk] by `fp8_block` (bn, bk)."""
    num_cols, width = weight.shape
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or (norm is not None and rows.stride(0) != width):
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    assert rows.shape[1] == (2 * width if silu_mul else width), (x.shape, weight.shape, silu_mul)
    assert weight.stride(-1) == 1 and (weight_scale is None) == (fp8_block is None)
    assert norm is None or not (silu_mul or config.row_acc), "a folded norm takes x itself, in tile loops"
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    residual = residual_out = rows
    if norm is not None and norm.residual is not None:
        residual = norm.residual.reshape(-1, width).contiguous()
        residual_out = torch.empty_like(rows) if norm.out_residual is None else norm.out_residual.view(rows.shape)
        assert residual_out.is_contiguous() and residual_out.dtype == rows.dtype
    if num_rows == 0:
        out = out.view(*x.shape[:-1], num_cols)
        return (out, residual_out.view(x.shape)) if norm is not None and norm.residual is not None else out
    fp8 = weight_scale is not None
    tiles_per_split, split_k = split_slices(triton.cdiv(width, config.block_k), config.split_k)
    grid = (triton.cdiv(num_cols, config.block_n), split_k, triton.cdiv(num_rows, config.block_m))
    if split_k > 1:
        partial = torch.empty(split_k, num_rows, num_cols, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
        assert grid[0] * grid[2] <= MAX_SPLIT_TILES, (grid, MAX_SPLIT_TILES)
    else:
        counters = split_counters(x.device)
        partial = counters.view(torch.float32)   # unused; typed as the split launches', so one compile serves both
    group_n, group_k = fp8_block if fp8 else (1, 1)
    pdl = config.pdl and pdl_launch.pdl_launches(x.device)
    launch(
        _gemv_kernel, grid,
        rows, weight, weight_scale if fp8 else weight, bias if bias is not None else out, out, partial, counters,
        residual, norm.weight if norm is not None else rows, residual_out,
        num_rows, num_cols, width, split_k, tiles_per_split, norm.eps if norm is not None else 0.0,
        rows.stride(0), weight.stride(0), weight_scale.stride(0) if fp8 else 0, out.stride(0),
        GROUP_N=group_n, GROUP_K=group_k, FP8=fp8, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
        EVEN_K=width % config.block_k == 0, USE_DOT=config.use_dot, PDL=pdl, ROW_ACC=config.row_acc,
        PREFETCH_TILES=config.prefetch, SPLIT_CHUNK=config.split_chunk, NUM_STAGES=config.num_stages,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        FP8_BITS=fp8 and config.fp8_bits, LATE_TRIGGER=config.late_trigger,
        NORM=norm is not None, NORM_RESIDUAL=norm is not None and norm.residual is not None,
        DOT_EARLY=config.use_dot and config.early_dot,
        SILU_FENCE=silu_mul and config.use_dot and config.block_m < WGMMA_MIN_ROWS and pdl_launch.pdl_launches(x.device),
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )
    out = out.view(*x.shape[:-1], num_cols)
    if norm is not None and norm.residual is not None:
        return out, residual_out.view(x.shape)
    return out
