"""Triton kernels that fuse the model's elementwise work, one launch where PyTorch needs many.

A decode step of a small model is dominated by tiny elementwise kernels (RMSNorm alone is about
seven: cast, square, mean, add, rsqrt, multiply, cast, weight): each reads and writes a few KiB
and costs a launch. These three kernels do each group in one pass:
- `rms_norm`: RMSNorm of each row, optionally after adding the residual (returning the sum as
  the next residual), like vLLM's fused_add_rms_norm.
- `silu_and_mul`: SwiGLU over the packed [gate | up] projection.
- `qk_norm_rope_`: Qwen3's per-head RMSNorm of q and k, then RoPE, in place over the packed qkv
  projection (one program per token covers all its q and k heads).
- `rms_norm_fp8`, `silu_and_mul_fp8`: the first two with their output quantized per token and
  group of columns for cuBLAS's block-scaled FP8 GEMM (fp8_kernels.Fp8Activation), where the
  next projection runs it: the quantization kernel it would launch first is gone. The values
  and scales are per_token_group_quant's of the unquantized kernel's output, bit for bit.
  WORKER_FP8_QUANT_FUSION=0 leaves the quantization to its own kernel (for comparisons).

On a Hopper each is one link of the decode layer's chain of programmatic dependent launches
(pdl_launch.pdl_waits): it lets the next kernel launch at its start and waits for the one before it.

Each rounds to the model dtype exactly where the torch path (layernorm.py, activation.py,
rotary.py, which mirror transformers) does, so bf16 results match it up to the order of float32
sums. The layers call these on CUDA tensors unless WORKER_FUSED_KERNELS=0 (for comparisons);
importing this module imports Triton, so the layers import it only once they see a CUDA tensor.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from worker_svc.layers import fp8_kernels, gemv_kernels, pdl_launch
from worker_svc.layers.fp8 import FP8_MAX, MIN_AMAX
from worker_svc.layers.pdl_launch import pdl_start

ENABLED = os.environ.get("WORKER_FUSED_KERNELS", "1") != "0"
FP8_QUANT_FUSION = os.environ.get("WORKER_FP8_QUANT_FUSION", "1") != "0"
SILU_BLOCK = 1024   # columns of the activation per program


@triton.jit
def rms_normed(x, rstd, weight, dtype: tl.constexpr):
    """float32 x scaled by its inverse RMS, rounded to the model dtype, times the norm's float32 weight,
    rounded again: where layernorm.py's RMSNorm (as transformers) rounds. Returned in the model dtype."""
    return ((x * rstd).to(dtype).to(tl.float32) * weight).to(dtype)


@triton.jit
def _add_rms_norm_row(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, stride_x, stride_r, stride_ro,
                      cols, mask, num_cols, eps, dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One row's RMSNorm (after the residual add, whose sum it stores) in the model dtype."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The sum is rounded to the model dtype first: it is the residual the torch path keeps.
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + residual).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, total, mask=mask)
        x = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / num_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return rms_normed(x, rstd, weight, dtype)


@triton.jit
def _quantize_groups(values, q_ptr, s_ptr, row, first_group, stride_q, stride_sm, stride_sg, num_cols,
                     GROUPS: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """Stores a row's values (GROUPS x GROUP of them, from column first_group * GROUP) as FP8 with
    one float32 scale per group, as fp8_kernels.per_token_group_quant does."""
    groups = first_group + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    q, scale = fp8_kernels.quantize_groups(tl.reshape(values.to(tl.float32), (GROUPS, GROUP)), FP8_MAX, MIN_AMAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < num_cols)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * GROUP < num_cols)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, num_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr,
):
    # TRIGGER: the projection after it may launch now (pdl_launch.pdl_triggers); WAIT: launched
    # with PDL, it waits for the kernel before (pdl_launch.pdl_waits)
    pdl_start(TRIGGER, WAIT)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    y = _add_rms_norm_row(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, stride_x, stride_r, stride_ro,
                          cols, mask, num_cols, eps, out_ptr.dtype.element_ty, HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


# The arguments that follow the step's row count are not specialised on (Triton would compile a
# variant for each of "equals 1" and "multiple of 16" the first time a step met it: mid-serving).
ROWS_ARGS = ["stride_sm", "stride_sg", "num_rows"]


@triton.jit(do_not_specialize=ROWS_ARGS)
def _rms_norm_fp8_kernel(
    x_ptr, residual_ptr, weight_ptr, q_ptr, s_ptr, residual_out_ptr,
    stride_x, stride_r, stride_q, stride_sm, stride_sg, stride_ro, num_rows, num_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr,
):
    pdl_start(TRIGGER, WAIT)   # as _rms_norm_kernel's
    # One program per row of the padded activation: rows past num_rows read nothing (zeros).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (cols < num_cols) & (row < num_rows)
    y = _add_rms_norm_row(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, stride_x, stride_r, stride_ro,
                          cols, mask, num_cols, eps, x_ptr.dtype.element_ty, HAS_RESIDUAL)
    _quantize_groups(y, q_ptr, s_ptr, row, 0, stride_q, stride_sm, stride_sg, num_cols,
                     BLOCK // GROUP, GROUP, FP8_MAX, MIN_AMAX)


@triton.jit
def _silu_mul_tile(x_ptr, row, stride_x, cols, mask, num_cols, dtype: tl.constexpr):
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + num_cols + cols, mask=mask, other=0.0)
    return gemv_kernels.silu_times(gate, up, dtype).to(dtype)   # (F.silu rounds its output: silu_times too)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, num_cols, BLOCK: tl.constexpr, TRIGGER: tl.constexpr,
                         WAIT: tl.constexpr):
    pdl_start(TRIGGER, WAIT)   # as _rms_norm_kernel's, for the down projection
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    y = _silu_mul_tile(x_ptr, row, stride_x, cols, mask, num_cols, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit(do_not_specialize=ROWS_ARGS)
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_sm, stride_sg, num_rows, num_cols,
                             BLOCK: tl.constexpr, GROUP: tl.constexpr,
                             FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, TRIGGER: tl.constexpr,
                             WAIT: tl.constexpr):
    pdl_start(TRIGGER, WAIT)   # as _rms_norm_kernel's, for the down projection
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < num_cols) & (row < num_rows)
    y = _silu_mul_tile(x_ptr, row, stride_x, cols, mask, num_cols, x_ptr.dtype.element_ty)
    _quantize_groups(y, q_ptr, s_ptr, row, tl.program_id(1) * (BLOCK // GROUP), stride_q, stride_sm, stride_sg,
                     num_cols, BLOCK // GROUP, GROUP, FP8_MAX, MIN_AMAX)


@triton.jit
def qk_norm_rope_tile(first, mask, heads, cols, q_weight_ptr, k_weight_ptr, cos_sin_row, q_eps, k_eps,
                      NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr):
    """One token's q heads then k heads, normalised and rotated: `first` points at the first half
    of each head (rows) by column; returns the two halves in the model dtype."""
    dtype = first.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    is_q = (heads < NUM_Q_HEADS)[:, None]
    eps = tl.where(heads < NUM_Q_HEADS, q_eps, k_eps)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
    col_mask = cols < HALF
    w1 = tl.where(is_q, tl.load(q_weight_ptr + cols, mask=col_mask, other=0.0)[None, :],
                  tl.load(k_weight_ptr + cols, mask=col_mask, other=0.0)[None, :]).to(tl.float32)
    w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + cols, mask=col_mask, other=0.0)[None, :],
                  tl.load(k_weight_ptr + HALF + cols, mask=col_mask, other=0.0)[None, :]).to(tl.float32)
    # RMSNorm as layernorm.py rounds it (normed, then times the weight), then RoPE in float32.
    n1 = rms_normed(x1, rstd, w1, dtype).to(tl.float32)
    n2 = rms_normed(x2, rstd, w2, dtype).to(tl.float32)
    cos = tl.load(cos_sin_row + cols, mask=col_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_row + HALF + cols, mask=col_mask, other=0.0)[None, :]
    return (n1 * cos - n2 * sin).to(dtype), (n2 * cos + n1 * sin).to(dtype)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr,
    stride_qkv, stride_cs, q_eps, k_eps,
    NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    # Rows of the tile are the token's q heads then its k heads (adjacent in the packed
    # projection); columns are one half of head_dim, since RoPE (neox layout) pairs the halves.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (cols < HALF)[None, :]
    first = qkv_ptr + token * stride_qkv + (heads * (2 * HALF))[:, None] + cols[None, :]
    y1, y2 = qk_norm_rope_tile(first, mask, heads, cols, q_weight_ptr, k_weight_ptr, cos_sin_ptr + token * stride_cs,
                               q_eps, k_eps, NUM_Q_HEADS, HALF)
    tl.store(first, y1, mask=mask)
    tl.store(first + HALF, y2, mask=mask)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a contiguous last dim (a view where strides allow)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim. With `residual`: (norm(x + residual), x + residual)."""
    assert weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    rows = _rows(x)
    num_rows, num_cols = rows.shape
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        residual_rows = residual_out = rows   # unused by the kernel
    else:
        residual_rows = _rows(residual)
        residual_out = torch.empty_like(out)
    if num_rows:
        block = _pow2(num_cols)
        _rms_norm_kernel[(num_rows,)](
            rows, residual_rows, weight, out, residual_out,
            rows.stride(0), residual_rows.stride(0), out.stride(0), residual_out.stride(0), num_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, **pdl_launch.pdl_chain_args(x.device), num_warps=_norm_warps(block),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    rows = _rows(gate_up)
    num_rows, num_cols = rows.shape[0], rows.shape[1] // 2
    out = torch.empty(num_rows, num_cols, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = min(SILU_BLOCK, _pow2(num_cols))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(num_cols, block))](
            rows, out, rows.stride(0), out.stride(0), num_cols, BLOCK=block, **pdl_launch.pdl_chain_args(gate_up.device), num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], num_cols)


def _norm_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, group: int
                 ) -> fp8_kernels.Fp8Activation | tuple[fp8_kernels.Fp8Activation, torch.Tensor]:
    """rms_norm(x, weight, eps, residual) with the normalised rows quantized per group of `group`
    columns for cuBLAS (fp8_kernels.Fp8Activation): what per_token_group_quant(rms_norm(...))
    gives, in one launch. With `residual`, (that, x + residual)."""
    assert weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    rows = _rows(x)
    num_rows, num_cols = rows.shape
    block = _pow2(num_cols)
    assert num_cols % group == 0 and group & (group - 1) == 0 and group <= block, (num_cols, group)
    out = fp8_kernels.empty_activation(num_rows, num_cols, group, x.dtype, x.device)
    if residual is None:
        residual_rows = residual_out = rows   # unused by the kernel
    else:
        residual_rows = _rows(residual)
        residual_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _rms_norm_fp8_kernel[(out.values.shape[0],)](
        rows, residual_rows, weight, out.values, out.scales, residual_out,
        rows.stride(0), residual_rows.stride(0), out.values.stride(0), out.scales.stride(0), out.scales.stride(1),
        residual_out.stride(0), num_rows, num_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, GROUP=group, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
        **pdl_launch.pdl_chain_args(x.device), num_warps=_norm_warps(block),
    )
    if residual is None:
        return out
    return out, residual_out.view(x.shape)


def silu_and_mul_fp8(gate_up: torch.Tensor, group: int) -> fp8_kernels.Fp8Activation:
    """silu_and_mul(gate_up) quantized per group of `group` columns for cuBLAS
    (fp8_kernels.Fp8Activation), in one launch."""
    rows = _rows(gate_up)
    num_rows, num_cols = rows.shape[0], rows.shape[1] // 2
    block = min(SILU_BLOCK, _pow2(num_cols))
    assert num_cols % group == 0 and group & (group - 1) == 0 and group <= block, (num_cols, group)
    out = fp8_kernels.empty_activation(num_rows, num_cols, group, gate_up.dtype, gate_up.device)
    _silu_and_mul_fp8_kernel[(out.values.shape[0], triton.cdiv(num_cols, block))](
        rows, out.values, out.scales, rows.stride(0), out.values.stride(0), out.scales.stride(0),
        out.scales.stride(1), num_rows, num_cols, BLOCK=block, GROUP=group,
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, **pdl_launch.pdl_chain_args(gate_up.device), num_warps=4,
    )
    return out


def fp8_fusion_fault(device: torch.device, dtype: torch.dtype, group: int = 128) -> str | None:
    """Why rms_norm_fp8 and silu_and_mul_fp8 cannot stand in for their unfused kernels and
    per_token_group_quant here (a compile failure, or any value or scale not theirs bit for bit),
    or None: they can. Run once at start-up, before the FP8 layers are planned."""
    generator = torch.Generator(device=device).manual_seed(0)
    rows, width = 6, 4 * group   # 6 rows: padded to 8
    try:
        x, residual = (torch.randn(rows, width, generator=generator, device=device).to(dtype) for _ in range(2))
        weight = torch.rand(width, generator=generator, device=device).to(dtype) + 0.5
        gate_up = torch.randn(rows, 2 * width, generator=generator, device=device).to(dtype) * 3
        cases = (("rms_norm_fp8", rms_norm_fp8(x, weight, 1e-6, residual, group)[0],
                  rms_norm(x, weight, 1e-6, residual)[0]),
                 ("silu_and_mul_fp8", silu_and_mul_fp8(gate_up, group), silu_and_mul(gate_up)))
        for name, fused, unfused in cases:
            values, scales = fp8_kernels.per_token_group_quant(unfused, group)
            if not (torch.equal(fused.values[:rows].view(torch.uint8), values.view(torch.uint8))
                    and torch.equal(fused.scales[:rows], scales)):
                return f"{name} differs from its unfused kernel and the quantization"
    except Exception as exc:   # noqa: BLE001 - any failure here means: keep the separate kernels
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def qk_norm_rope_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float,
                  k_eps: float, cos_sin: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> None:
    """In place over qkv [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]: each q and
    k head is RMS-normalised with its weight, then rotated by cos_sin [num_tokens, head_dim]
    (cos | sin, float32). The v part is left alone."""
    head_dim = q_weight.shape[0]
    num_tokens = qkv.shape[0]
    assert head_dim % 2 == 0 and qkv.stride(-1) == 1 and cos_sin.stride(-1) == 1
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim and cos_sin.shape == (num_tokens, head_dim)
    if num_tokens == 0:
        return
    num_heads = num_q_heads + num_kv_heads
    _qk_norm_rope_kernel[(num_tokens,)](
        qkv, q_weight, k_weight, cos_sin, qkv.stride(0), cos_sin.stride(0), q_eps, k_eps,
        NUM_Q_HEADS=num_q_heads, NUM_HEADS=num_heads, HEADS_PAD=_pow2(num_heads),
        HALF=head_dim // 2, HALF_PAD=_pow2(head_dim // 2), num_warps=4,
    )
