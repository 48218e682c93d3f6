"""Block-scaled FP8 GEMM (Triton) for the -FP8 checkpoints' weights (worker_svc/layers/fp8.py).

y = x @ W^T + bias, W in float8_e4m3fn with one float32 scale per bn x bk block. x is quantized
on the fly per token and group of bk columns (`per_token_group_quant`: each group scaled so its
largest magnitude is 448, the scale kept in float32). The GEMM then walks K one group at a
time, so each step's FP8 tile product is scaled by one activation scale per row and one weight
scale per output column, accumulated in float32 and rounded once to x's dtype:
    acc += (A_q[:, k-group] @ W_q[:, k-group]^T) * a_scale[:, k] * w_scale[n // bn, k]
With `quantize_on_load` the GEMM quantizes each activation tile as it loads it (one launch, no
quantization kernel; the tile is quantized once per column tile, which costs little next to
the weight read at decode). `cublas_fp8_linear` runs the same product through cuBLAS's
block-scaled FP8 GEMM where torch and the device have it; its input may come quantized already
(an `Fp8Activation`, from the RMSNorm or SwiGLU kernel that produced it: fused_kernels), so no
quantization kernel runs between them.
Shapes depend only on the token count, and nothing is read back to the host, so the layers
that call this are capturable in CUDA graphs. Under TRITON_INTERPRET=1 the kernels run on the
CPU (slowly) for the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from worker_svc.layers import gemv_kernels, pdl_launch
from worker_svc.layers.fp8 import MIN_AMAX, FP8_DTYPE, FP8_MAX
from worker_svc.layers.gemv_kernels import (MAX_SPLIT_TILES, finish_split_k, prefetch_rows_l2, split_counters,
                                            split_slices)
from worker_svc.layers.triton_compile import launch


@triton.jit
def quantize_groups(x, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """(FP8 values as float32, scales) of x [groups, group] in float32, one scale per group
    (its largest magnitude over FP8_MAX). Correctly rounded divisions (Triton's `/` is the GPU's
    approximate one): the scales and values are then exactly torch's, bit for bit."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), FP8_MAX)
    return tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX), scale


# Scale strides follow the row count when scales are laid out for cuBLAS: not specialised on (a
# step of a new row count would compile a variant mid-serving).
@triton.jit(do_not_specialize=["stride_s", "stride_sg"])
def _token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, stride_sg, num_groups,
    GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups < num_groups)[:, None]
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, FP8_MAX, MIN_AMAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + groups * stride_sg, scale, mask=groups < num_groups)


def per_token_group_quant(x: torch.Tensor, group: int, *, rows_major_scales: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values [M, K], float32 scales [M, K / group]) of x [M, K]: x ~ values * scale per group.
    With rows_major_scales the scales are laid out column by column (strides (1, M)), as
    cuBLAS's 1 x 128 block scaling reads them."""
    num_rows, width = x.shape
    assert width % group == 0 and group & (group - 1) == 0, (width, group)
    assert x.stride(-1) == 1
    num_groups = width // group
    values = torch.empty(num_rows, width, dtype=FP8_DTYPE, device=x.device)
    if rows_major_scales:
        scales = torch.empty(num_groups, num_rows, dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows:
        per_program = min(triton.next_power_of_2(num_groups), max(1, 2048 // group))
        _token_group_quant_kernel[(num_rows, triton.cdiv(num_groups, per_program))](
            x, values, scales, x.stride(0), values.stride(0), scales.stride(0), scales.stride(1), num_groups,
            GROUP=group, GROUPS_PER_PROGRAM=per_program, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=4,
        )
    return values, scales


@triton.jit
def _quantize_tile(a, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """(FP8 values, float32 scales [rows]) of a float32 tile, one group per row: the scale is
    per_token_group_quant's; values are multiplied by its reciprocal, which rounds differently
    from its division in rare last bits."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=1), MIN_AMAX), FP8_MAX)
    values = tl.clamp(a * tl.math.div_rn(1.0, scale)[:, None], -FP8_MAX, FP8_MAX)
    return values.to(tl.float8e4nv), scale


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` of an [M, N] output: programs sweep GROUP_M row tiles for
    each column tile, so a weight tile is read from L2 by several row tiles in a row."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _row_tile(a_ptr, cols, k_end, K, SILU_MUL: tl.constexpr):
    """Row 0's activations at cols [1, BLOCK_K] (zero from k_end on): (gate, up) of [gate | up] with
    SILU_MUL (up lies K columns later), else (x, x)."""
    mask = cols < k_end
    first = tl.load(a_ptr + cols, mask=mask, other=0.0)
    second = first
    if SILU_MUL:
        second = tl.load(a_ptr + K + cols, mask=mask, other=0.0)
    return first, second


@triton.jit(do_not_specialize=["M", "stride_as", "stride_ask"])
def _block_fp8_matmul_kernel(
    a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, bias_ptr, partial_ptr, counter_ptr,
    M, N, K, groups_per_split, stride_am, stride_as, stride_ask, stride_bn, stride_bs, stride_cm,
    GROUP_N: tl.constexpr, HAS_BIAS: tl.constexpr, QUANTIZE_A: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr, PREFETCH_TILES: tl.constexpr, LATE_TRIGGER: tl.constexpr,
    SWAP_AB: tl.constexpr = False, SILU_MUL: tl.constexpr = False, ONE_ROW: tl.constexpr = False,
):
    # Programs take their output tiles in grouped_tile's order. With SPLIT_K > 1, program_id(1) takes one of SPLIT_K slices
    # of K (groups_per_split groups each) and the tile's last program to finish sums the slices.
    # PDL (programmatic dependent launch, as gemv_kernels'): the kernel may start while the one
    # before it ends; it asks L2 for its first PREFETCH_TILES weight tiles (weights never depend
    # on that kernel), then waits for it before reading anything it wrote (the activations and
    # their scales, and the split-K counters). With LATE_TRIGGER the next kernel may launch only
    # once this one's loop is done (gemv_kernels' late_trigger). With SWAP_AB (a few rows, activations
    # quantized ahead) the dot takes the weight tile as its 64-row operand and the rows' activations as
    # the narrow one (BLOCK_M of 16-64 columns): Hopper's wgmma on e4m3 without padding the rows to 64
    # (PERF_NOTES v41), the accumulator BLOCK_N x BLOCK_M, transposed once at the end. With SILU_MUL (and
    # QUANTIZE_A) a is [gate | up], 2K wide: each tile is silu(gate) * up, rounded as fused_kernels.silu_and_mul
    # rounds it, then quantized (the down projection without a SwiGLU kernel before it).
    tl.static_assert(QUANTIZE_A or not SILU_MUL, "SwiGLU on load quantizes on load")
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL and not LATE_TRIGGER:
        gdc_launch_dependents()
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_begin = pid_k * groups_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + groups_per_split * BLOCK_K, K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + (k_begin + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + (k_begin + offs_k)[:, None]
    a_s_ptrs = a_s_ptr + offs_m * stride_as
    b_s_ptrs = b_s_ptr + (offs_n // GROUP_N) * stride_bs
    if PDL:
        if PREFETCH_TILES > 0:
            rows = b_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_bn + k_begin
            span = tl.minimum(k_end - k_begin, PREFETCH_TILES * BLOCK_K)   # FP8: one byte an element
            prefetch_rows_l2(rows, tl.full((BLOCK_N,), 0, tl.int32) + span)
        gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QUANTIZE_A and ONE_ROW:   # the row's first K tile (gate and up with SILU_MUL), then one tile ahead
        gate_next, up_next = _row_tile(a_ptr, k_begin + offs_k[None, :], k_end, K, SILU_MUL)
    for k in range(k_begin, k_end, BLOCK_K):   # K is whole groups: no mask along it
        if QUANTIZE_A and ONE_ROW:   # row 0 alone is real: its activation (SwiGLU's) and quantization as one
            # [1, BLOCK_K] row, each element once, then the tile's other rows zero (their scales too); the
            # 16-row tile would spend the same work on its 15 padded rows (PERF_NOTES v50). The row's next
            # tile is loaded before this one is used (loads the pipeline does not take: not a dot's operand).
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            gate, up = gate_next, up_next
            gate_next, up_next = _row_tile(a_ptr, k + BLOCK_K + offs_k[None, :], k_end, K, SILU_MUL)
            if SILU_MUL:
                row = gemv_kernels.silu_times(gate, up, a_ptr.dtype.element_ty).to(a_ptr.dtype.element_ty)
            else:
                row = gate
            row_q, row_s = _quantize_tile(row.to(tl.float32), FP8_MAX, MIN_AMAX)
            a = tl.where(offs_m[:, None] == 0, row_q.to(tl.float32), 0.0).to(tl.float8e4nv)
            a_s = tl.where(offs_m == 0, tl.sum(row_s, axis=0), 0.0)
        else:
            a = gemv_kernels._load_x(a_ptrs, m_mask[:, None], K, SILU_MUL, a_ptr.dtype.element_ty)   # (or SwiGLU's)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            if QUANTIZE_A:   # activations in the model dtype, quantized per row and group here
                a, a_s = _quantize_tile(a.to(tl.float32), FP8_MAX, MIN_AMAX)
            else:
                a_s = tl.load(a_s_ptrs + (k // BLOCK_K) * stride_ask, mask=m_mask, other=0.0)
        b_s = tl.load(b_s_ptrs + k // BLOCK_K, mask=n_mask, other=0.0)
        if SWAP_AB:
            acc += tl.dot(tl.trans(b), tl.trans(a)) * b_s[:, None] * a_s[None, :]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    if PDL and LATE_TRIGGER:
        gdc_launch_dependents()
    finish_split_k(acc, partial_ptr, counter_ptr, pid, pid_k, SPLIT_K, M, N, offs_m, offs_n, n_mask,
                   m_mask[:, None] & n_mask[None, :], bias_ptr, c_ptr, stride_cm, HAS_BIAS, 1)


def _matmul_config(num_rows: int) -> dict:
    """Tile sizes by the number of rows: decode batches are thin (read-bound: many narrow
    column tiles keep every SM busy); prefill is compute-bound (square tiles)."""
    if num_rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4)
    if num_rows <= 64:
        return dict(BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4)
    if num_rows <= 512:
        return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)


def block_fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                     config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:
    """a [M, K] FP8 with a_scale [M, K / bk] (any strides), or a in the model dtype with a_scale
    None (then quantized per token group as the GEMM loads it; with `silu_mul` a is [gate | up],
    [M, 2K], and the GEMM multiplies silu(gate) * up as it loads it); weight [N, K] FP8 with
    weight_scale [ceil(N / bn), K / bk]: (a @ weight^T) dequantized, plus bias, as out_dtype [M, N]."""
    num_rows, width = a.shape
    num_cols = weight.shape[0]
    bn, bk = block
    quantize_a = a_scale is None
    assert quantize_a or not silu_mul, "SwiGLU on load quantizes on load"
    width //= 2 if silu_mul else 1
    assert weight.shape[1] == width and width % bk == 0, (a.shape, weight.shape, block)
    assert quantize_a or a_scale.shape == (num_rows, width // bk), (a_scale.shape, a.shape)
    assert weight_scale.shape == (-(-num_cols // bn), width // bk), (weight_scale.shape, weight.shape)
    assert weight.stride(-1) == 1 and weight_scale.stride(-1) == 1 and a.stride(-1) == 1
    out = torch.empty(num_rows, num_cols, dtype=out_dtype, device=a.device)
    if num_rows == 0:
        return out
    config = dict(config or _matmul_config(num_rows))
    pdl = config.pop("PDL", False) and pdl_launch.pdl_launches(a.device)
    prefetch = config.pop("PREFETCH", 0) if pdl else 0
    late = config.pop("LATE_TRIGGER", False) and pdl
    groups_per_split, split_k = split_slices(width // bk, config.pop("SPLIT_K", 1))
    tiles = triton.cdiv(num_rows, config["BLOCK_M"]) * triton.cdiv(num_cols, config["BLOCK_N"])
    if split_k > 1:
        assert tiles <= MAX_SPLIT_TILES, (tiles, MAX_SPLIT_TILES)
        partial = torch.empty(split_k, num_rows, num_cols, dtype=torch.float32, device=a.device)
        counters = split_counters(a.device)
    else:
        partial = counters = out   # unused (SPLIT_K is a constant: the variant without slices reads neither)
    launch(
        _block_fp8_matmul_kernel, (tiles, split_k),
        a, weight_scale if quantize_a else a_scale, weight, weight_scale, out, bias if bias is not None else out,
        partial, counters, num_rows, num_cols, width, groups_per_split, a.stride(0), 0 if quantize_a else a_scale.stride(0),
        0 if quantize_a else a_scale.stride(1), weight.stride(0),
        weight_scale.stride(0), out.stride(0), GROUP_N=bn, HAS_BIAS=bias is not None, QUANTIZE_A=quantize_a,
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, BLOCK_K=bk, SPLIT_K=split_k, PDL=pdl, PREFETCH_TILES=prefetch,
        LATE_TRIGGER=late, SILU_MUL=silu_mul, ONE_ROW=quantize_a and num_rows == 1, launch_pdl=pdl, **config,
    )
    return out


def fp8_linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
               block: tuple[int, int], bias: torch.Tensor | None = None, *, quantize_on_load: bool = False,
               config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:
    """F.linear(x, dequantized weight, bias) with x quantized per token group of bk on the fly:
    by per_token_group_quant first, or inside the GEMM (`quantize_on_load`: one launch; with
    `silu_mul` x is [gate | up] and the GEMM takes silu(gate) * up); or x quantized already by the
    kernel that produced it (an Fp8Activation: [num_rows, N] out)."""
    assert quantize_on_load or not silu_mul, "SwiGLU folds into the GEMM that quantizes on load"
    if isinstance(x, Fp8Activation):
        n = x.num_rows
        return block_fp8_matmul(x.values[:n], x.scales[:n], weight, weight_scale, block, x.dtype, bias, config)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if quantize_on_load:
        out = block_fp8_matmul(rows, None, weight, weight_scale, block, x.dtype, bias, config, silu_mul=silu_mul)
    else:
        values, scales = per_token_group_quant(rows, block[1])
        out = block_fp8_matmul(values, scales, weight, weight_scale, block, x.dtype, bias, config)
    return out.view(*x.shape[:-1], weight.shape[0])


# cuBLASLt's block scaling takes the token count only in multiples of 4 (else it finds no
# algorithm: CUBLAS_STATUS_NOT_SUPPORTED): zero rows pad it, and their outputs are dropped.
CUBLAS_ROW_MULTIPLE = 4


def cublas_rows(num_rows: int) -> int:
    """The row count cuBLAS's block-scaled GEMM is called with: num_rows padded with zero rows."""
    return -(-num_rows // CUBLAS_ROW_MULTIPLE) * CUBLAS_ROW_MULTIPLE


@dataclass(frozen=True)
class Fp8Activation:
    """An activation quantized per token and group of columns for cuBLAS's block-scaled GEMM by
    the kernel that produced it: values [cublas_rows(num_rows), K] FP8 (the rows past num_rows
    zeros) and float32 scales of the same rows by K / group, laid out column by column (strides
    (1, rows)); `dtype` is the model dtype the product comes back in."""
    values: torch.Tensor
    scales: torch.Tensor
    num_rows: int
    dtype: torch.dtype


def empty_activation(num_rows: int, width: int, group: int, dtype: torch.dtype, device: torch.device
                     ) -> Fp8Activation:
    """Room for a kernel to write an Fp8Activation of num_rows x width into."""
    rows = cublas_rows(num_rows)
    values = torch.empty(rows, width, dtype=FP8_DTYPE, device=device)
    scales = torch.empty(width // group, rows, dtype=torch.float32, device=device).t()
    return Fp8Activation(values, scales, num_rows, dtype)


def quantize_activation(x: torch.Tensor, group: int) -> Fp8Activation:
    """x [..., K] in the model dtype as an Fp8Activation (per_token_group_quant, rows padded):
    what a kernel that quantizes its output for cuBLAS gives, from a kernel of its own."""
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    if num_rows % CUBLAS_ROW_MULTIPLE:
        rows = F.pad(rows, (0, 0, 0, cublas_rows(num_rows) - num_rows))
    elif rows.stride(-1) != 1:
        rows = rows.contiguous()
    values, scales = per_token_group_quant(rows, group, rows_major_scales=True)
    return Fp8Activation(values, scales, num_rows, x.dtype)


def cublas_weight_scales(weight_scale: torch.Tensor) -> torch.Tensor:
    """A weight's [N / bn, K / bk] block scales as cuBLAS's 128 x 128 block scaling reads them:
    K blocks padded to a multiple of 4, laid out K-block-major ([K4, N / bn], strides (1, K4))."""
    padded = F.pad(weight_scale, (0, -weight_scale.shape[1] % 4))
    return padded.t()


def cublas_fp8_linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor, cublas_scales: torch.Tensor,
                      block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear through cuBLAS's block-scaled FP8 GEMM (torch's scaled_mm, 1 x 128 activation
    blocks by 128 x 128 weight blocks: Hopper with CUDA 12.9+); cublas_scales from
    cublas_weight_scales. x in the model dtype is quantized here; an Fp8Activation is used as it
    is ([num_rows, N] out). Raises where this torch or device lacks it."""
    if isinstance(x, Fp8Activation):
        lead = (x.num_rows,)
    else:
        lead, x = x.shape[:-1], quantize_activation(x, block[1])
    out = block_scaled_mm(x.values, weight, x.scales, cublas_scales, x.dtype)[:x.num_rows]
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


def block_scaled_mm(values: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, cublas_scales: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """values [M, K] FP8 (M a multiple of 4) with 1 x 128 block scales, by weight [N, K] with
    128 x 128 block scales (cublas_weight_scales): [M, N] in out_dtype, by cuBLAS."""
    return F.scaled_mm(values, weight.t(), scales, F.ScalingType.BlockWise1x128, cublas_scales,
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
