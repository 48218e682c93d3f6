"""The ways a linear layer can compute its product on a GPU, and the plan that picks one by the
number of rows.

A layer's operands (`LinearOperands`) are its weight (the model dtype, or FP8 values with
block scales) and whether its input is [gate | up], to be multiplied as silu(gate) * up first
(the MLP's down projection). A `Method` binds to operands and returns a runner
`run(x, bias) -> y`:
- `Cublas`: F.linear (the activation, if any, by fused_kernels.silu_and_mul first);
- `Gemv`: gemv_kernels' few-row kernel (FP8 weights dequantized inside it, the activation
  applied as it loads x); with `fold_norm`, for a layer an RMSNorm feeds, the norm computed in
  it too: the norm hands it a `NormedInput` (its `takes_norm` tells the norm to: linear.py);
- `Fp8Gemm`: fp8_kernels' block-scaled FP8 x FP8 GEMM, activations quantized inside it
  (`quantize_on_load`) or before it (as for Fp8Cublas);
- `Fp8Cublas`: cuBLAS's block-scaled FP8 GEMM (torch's scaled_mm), its input quantized before
  it: by the RMSNorm that produced it (the layer's `quant_group` tells the norm to: linear.py),
  after SwiGLU in the same kernel, or else by a kernel of its own (`QuantizedInputRunner`);
- `Dequantized`: F.linear over a bf16 copy of an FP8 weight (costs that copy's memory).
A `LinearPlan` maps row counts to runners (chosen by linear_selection at start-up); every
runner is graph-capturable, so the plan runs inside the decode graphs.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from worker_svc.layers import fp8_kernels, fused_kernels
from worker_svc.layers.fp8 import dequantize_blocks
from worker_svc.layers.gemv_kernels import FoldedNorm, GemvConfig, gemv, prefetch_label

Runner = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class NormedInput:
    """A layer's input still to be normalised: what an RMSNorm hands the projection it feeds when
    that projection's runner for the row count folds the norm in (`takes_norm`)."""
    x: torch.Tensor
    norm: FoldedNorm

    @property
    def num_rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]
SILU_AND_MUL = "silu_and_mul"


@dataclass(frozen=True)
class LinearOperands:
    weight: torch.Tensor                   # [N, K]: the model dtype, or float8_e4m3fn values
    weight_scale: torch.Tensor | None = None   # FP8: [ceil(N / bn), K / bk] float32
    block: tuple[int, int] | None = None       # FP8: (bn, bk)
    silu_mul: bool = False                 # the input is [gate | up] (2K wide)
    norm_fed: bool = False                 # the input comes from an RMSNorm, which can quantize it

    @property
    def fp8(self) -> bool:
        return self.weight_scale is not None

    @property
    def input_width(self) -> int:
        return self.weight.shape[1] * (2 if self.silu_mul else 1)

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        return fused_kernels.silu_and_mul(x) if self.silu_mul else x

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (FP8 values times their scales)."""
        if not self.fp8:
            return self.weight.to(dtype)
        return dequantize_blocks(self.weight, self.weight_scale, self.block, dtype)


class Method:
    """A way to compute a layer's product; `max_rows` None: any number of rows."""
    name: str = ""
    max_rows: int | None = None
    extra_weight_bytes: bool = False   # binding allocates a copy of the weight
    compiles: bool = False             # runs Triton kernels of its own (compiled ahead at start-up)

    def supports(self, operands: LinearOperands, dtype: torch.dtype) -> bool:
        return True

    def bind(self, operands: LinearOperands, dtype: torch.dtype) -> Runner:
        raise NotImplementedError

    def late_twin(self) -> "Method | None":
        """The same launch with programmatic dependent launch's trigger after the main loop
        instead of at the start (linear_selection times it where this one wins), or None."""
        return None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Cublas(Method):
    name = "cublas"

    def supports(self, operands: LinearOperands, dtype: torch.dtype) -> bool:
        return not operands.fp8

    def bind(self, operands: LinearOperands, dtype: torch.dtype) -> Runner:
        weight = operands.weight
        return lambda x, bias: F.linear(operands.activate(x), weight, bias)


@dataclass(frozen=True)
class Dequantized(Method):
    name = "bf16-dequantized"
    extra_weight_bytes = True

    def supports(self, operands: LinearOperands, dtype: torch.dtype) -> bool:
        return operands.fp8

    def bind(self, operands: LinearOperands, dtype: torch.dtype) -> Runner:
        weight = operands.dense_weight(dtype)
        return lambda x, bias: F.linear(operands.activate(x), weight, bias)


@dataclass(frozen=True)
class Gemv(Method):
    config: GemvConfig
    max_rows: int = 64
    fold_norm: bool = False   # the RMSNorm before the layer computed in the kernel (takes a NormedInput)
    compiles = True

    @property
    def name(self) -> str:
        return f"gemv({self.config}){' +norm' if self.fold_norm else ''}"

    def supports(self, operands: LinearOperands, dtype: torch.dtype) -> bool:
        from worker_svc.layers.gemv_kernels import check_config

        if self.fold_norm and not (operands.norm_fed and not operands.silu_mul and not self.config.row_acc):
            return False
        try:
            check_config(self.config, *operands.weight.shape, fp8_block=operands.block, dtype=dtype)
        except ValueError:
            return False
        return True

    def bind(self, operands: LinearOperands, dtype: torch.dtype) -> Runner:
        weight, scale, block, config, silu_mul = (operands.weight, operands.weight_scale, operands.block,
                                                  self.config, operands.silu_mul)
        if self.fold_norm:
            return NormFoldingRunner(lambda x, bias, norm: gemv(x, weight, config, bias=bias, weight_scale=scale,
                                                                 fp8_block=block, norm=norm))
        return lambda x, bias: gemv(x, weight, config, bias=bias, weight_scale=scale, fp8_block=block,
                                    silu_mul=silu_mul)

    def late_twin(self) -> "Gemv | None":
        if not self.config.pdl or self.config.late_trigger:
            return None
        return Gemv(dataclasses.replace(self.config, late_trigger=True), self.max_rows, self.fold_norm)


class NormFoldingRunner:
    """A runner that takes the RMSNorm's NormedInput and computes norm and product in one kernel
    (the new residual written where the NormedInput says); given a plain tensor, the product of it."""
    takes_norm = True

    def __init__(self, run: Callable) -> None:
        self._run = run

    def __call__(self, x: "torch.Tensor | NormedInput", bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, NormedInput):
            out = self._run(x.x, bias, x.norm)
            return out[0] if isinstance(out, tuple) else out
        return self._run(x, bias, None)


@dataclass(frozen=True)
class Fp8Gemm(Method):
    config: tuple[tuple[str, int], ...]   # fp8_kernels tile settings, as sorted items
    quantize_on_load: bool = True
    compiles = True

    @classmethod
    def of(cls, config: dict, quantize_on_load: bool = True) -> "Fp8Gemm":
        return cls(tuple(sorted(config.items())), quantize_on_load)

    @property
    def name(self) -> str:
        settings = dict(self.config)
        tiles = f"{settings['BLOCK_M']}x{settings['BLOCK_N']} w{settings['num_warps']} s{settings['num_stages']}"
        if settings.get("SPLIT_K", 1) > 1:
            tiles += f" split{settings['SPLIT_K']}"
        if settings.get("PDL"):
            tiles += " pdl" + prefetch_label(settings.get("PREFETCH", 0))
            tiles += " late" if settings.get("LATE_TRIGGER") else ""
        if settings.get("SWAP_AB"):
            tiles += " swap"
        return f"fp8-gemm({'on-load' if self.quantize_on_load else 'quant+'} {tiles})"

    def supports(self, operands: LinearOperands, dtype: torch.dtype) -> bool:
        return operands.fp8

    def bind(self, operands: LinearOperands, dtype: torch.dtype) -> Runner:
        weight, scale, block, config = operands.weight, operands.weight_scale, operands.block, dict(self.config)
        if self.quantize_on_load:
            silu_mul = operands.silu_mul   # SwiGLU folded into the load: no kernel before it
            return lambda x, bias: fp8_kernels.fp8_linear(x, weight, scale, block, bias, quantize_on_load=True,
                                                          config=config, silu_mul=silu_mul)
        return QuantizedInputRunner(operands, lambda x, bias: fp8_kernels.fp8_linear(x, weight, scale, block, bias,
                                                                                     config=config))

    def late_twin(self) -> "Fp8Gemm | None":
        settings = dict(self.config)
        if not settings.get("PDL") or settings.get("LATE_TRIGGER"):
            return None
        return Fp8Gemm.of({**settings, "LATE_TRIGGER": True}, self.quantize_on_load)


@dataclass(frozen=True)
class Fp8Cublas(Method):
    name = "fp8-cublas"

    def supports(self, operands: LinearOperands, dtype: torch.dtype) -> bool:
        return operands.fp8 and operands.block == (128, 128) and operands.weight.shape[0] % 128 == 0

    def bind(self, operands: LinearOperands, dtype: torch.dtype) -> Runner:
        weight, block = operands.weight, operands.block
        scales = fp8_kernels.cublas_weight_scales(operands.weight_scale)
        return QuantizedInputRunner(operands, lambda x, bias: fp8_kernels.cublas_fp8_linear(x, weight, scales, block,
                                                                                            bias))


class QuantizedInputRunner:
    """An FP8 x FP8 product bound to a layer, `gemm(x, bias)` taking x in the model dtype
    (quantizing it by a kernel of its own) or as an fp8_kernels.Fp8Activation of `quant_group`-wide
    groups, which the kernel producing x quantized already. SwiGLU's input (the down projection)
    is activated and quantized here in one kernel."""

    def __init__(self, operands: LinearOperands, gemm: Runner) -> None:
        self.gemm, self.silu_mul, self.quant_group = gemm, operands.silu_mul, operands.block[1]

    def __call__(self, x: torch.Tensor | fp8_kernels.Fp8Activation, bias: torch.Tensor | None) -> torch.Tensor:
        if self.silu_mul and not isinstance(x, fp8_kernels.Fp8Activation):
            x = (fused_kernels.silu_and_mul_fp8(x, self.quant_group) if fused_kernels.FP8_QUANT_FUSION
                 else fused_kernels.silu_and_mul(x))
        return self.gemm(x, bias)


class LinearPlan:
    """Runs a layer's product with the runner chosen for the row count: runners[i] serves row
    counts up to bounds[i] (and above bounds[i - 1]); `beyond` serves more rows than the last."""

    def __init__(self, bounds: list[int], runners: list[Runner], beyond: Runner) -> None:
        assert len(bounds) == len(runners) and bounds == sorted(bounds)
        self.bounds, self.runners, self.beyond = bounds, runners, beyond

    def runner_for(self, num_rows: int) -> Runner:
        i = bisect.bisect_left(self.bounds, num_rows)
        return self.runners[i] if i < len(self.runners) else self.beyond

    def quant_group(self, num_rows: int) -> int | None:
        """The column group whose FP8 quantization the runner for num_rows takes as its input
        (an fp8_kernels.Fp8Activation), or None: it takes the model dtype."""
        return getattr(self.runner_for(num_rows), "quant_group", None)

    def takes_norm(self, num_rows: int) -> bool:
        """Whether the runner for num_rows folds the RMSNorm before the layer in (takes a NormedInput)."""
        return getattr(self.runner_for(num_rows), "takes_norm", False)

    def __call__(self, x: torch.Tensor | fp8_kernels.Fp8Activation | NormedInput,
                 bias: torch.Tensor | None) -> torch.Tensor:
        num_rows = (x.num_rows if isinstance(x, (fp8_kernels.Fp8Activation, NormedInput))
                    else x.numel() // x.shape[-1])
        return self.runner_for(num_rows)(x, bias)
