"""Block-wise FP8 weights, in the format of the official Qwen3 `-FP8` checkpoints.

config.json: `quantization_config: {quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic",
weight_block_size: [bn, bk]}` (the official ones use [128, 128]). A quantized linear weight W
[out, in] is stored as `weight` (float8_e4m3fn) and `weight_scale_inv` [ceil(out / bn),
ceil(in / bk)]: each bn x bk block of W equals its FP8 values times that block's scale. Scales
are kept in float32 here, whatever dtype the checkpoint stored them in.

Where the model runs:
- `kernel=True` (CUDA GPUs with FP8 tensor cores, compute capability 8.9 and up): weights stay
  FP8 and the GEMMs are worker_svc.layers.fp8_kernels, which quantize activations on the fly per
  token and group of bk columns (dynamic).
- `kernel=False` (the CPU, older GPUs): weights are dequantized at load into the model dtype; the
  model then computes with exactly the FP8 values, in full precision.
`--quantization fp8` quantizes a bf16 checkpoint at load time into the same format (on the CPU:
quantized, then dequantized). Quantized: every linear layer of the decoder layers (attention,
MLP, experts). Never the embeddings, the LM head, the norms or the MoE router, nor any module
the checkpoint names in `modules_to_not_convert`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)   # 448
DEFAULT_BLOCK = (128, 128)
QUANTIZATION_METHODS = ("fp8",)
# A block of zeros gets this scale instead of 0, so that dividing by it stays finite.
MIN_AMAX = 1e-12


@dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int] = DEFAULT_BLOCK   # (rows, columns) of a weight block: weight_block_size
    kernel: bool = True                      # keep FP8 weights and run FP8 GEMMs; False: dequantize
    skip: tuple[str, ...] = ()               # modules_to_not_convert

    def for_modules(self, *names: str) -> "Fp8Config | None":
        """This config for a layer holding the checkpoint modules `names` (a packed layer holds
        several), or None when the checkpoint keeps them unquantized."""
        skipped = [any(f".{entry}." in f".{name}." for entry in self.skip) for name in names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"modules_to_not_convert lists some of {', '.join(names)} but not all; they are "
                             "packed into one layer, which is either quantized or not")
        return self


def resolve_quantization(model_config, requested: str | None, device: torch.device) -> Fp8Config | None:
    """The model's quantization: the checkpoint's quantization_config, or `requested` ("fp8":
    quantize a full-precision checkpoint at load), or None."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {requested!r} is not supported (choose from {', '.join(QUANTIZATION_METHODS)})")
    kernel = has_fp8_tensor_cores(device)
    spec = getattr(model_config, "quantization_config", None)
    if (spec or requested) and device.type == "cuda" and not kernel:
        logger.warning("%s has no FP8 tensor cores: FP8 weights are dequantized at load", device)
    if not spec:
        return Fp8Config(kernel=kernel) if requested == "fp8" else None
    method = spec.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (only block-wise fp8)")
    if spec.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {spec['fmt']!r} is not supported (only e4m3)")
    if spec.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {spec['activation_scheme']!r} is not supported "
                         "(only dynamic: activations are quantized per token group at run time)")
    block = spec.get("weight_block_size")
    if not block or len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size must be [rows, columns], got {block!r} "
                         "(per-tensor FP8 checkpoints are not supported)")
    return Fp8Config(block=(int(block[0]), int(block[1])), kernel=kernel,
                     skip=tuple(spec.get("modules_to_not_convert") or ()))


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Ada and Hopper (compute capability 8.9+) multiply float8_e4m3fn natively."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., rows, cols] zero-padded to whole blocks, as [..., row blocks, bn, col blocks, bk]."""
    bn, bk = block
    rows, cols = x.shape[-2:]
    padded = F.pad(x, (0, -cols % bk, 0, -rows % bn))
    return padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values [..., rows, cols], float32 scales [..., ceil(rows / bn), ceil(cols / bk)]) of
    weight [..., rows, cols]: each block scaled so its largest magnitude becomes FP8_MAX."""
    rows, cols = weight.shape[-2:]
    blocks = _blocked(weight.float(), block)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(MIN_AMAX) / FP8_MAX
    values = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    values = values.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols]
    return values.contiguous(), scale


def dequantize_blocks(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """values [..., rows, cols] times their blocks' scales, in float32, then cast to dtype."""
    rows, cols = values.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (values.float() * scale[..., :rows, :cols]).to(dtype)


class BlockFp8Tensor(NamedTuple):
    """A checkpoint's FP8 weight with its block scales, as the loader hands it to a layer."""
    values: torch.Tensor      # float8_e4m3fn [..., rows, cols]
    scale_inv: torch.Tensor   # [..., ceil(rows / bn), ceil(cols / bk)]
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.values, self.scale_inv, self.block, dtype)

    def narrow(self, dim: int, start: int, length: int) -> "BlockFp8Tensor":
        """Rows (dim -2) or columns (dim -1) start..start+length, which must begin on a block
        boundary and end on one or at the end of the tensor."""
        dim = dim % self.values.ndim
        if dim < self.values.ndim - 2:
            return BlockFp8Tensor(self.values.narrow(dim, start, length), self.scale_inv.narrow(dim, start, length),
                                  self.block)
        b = self.block[dim - (self.values.ndim - 2)]
        end = start + length
        if start % b or (end % b and end != self.values.shape[dim]):
            raise ValueError(f"cannot take {'rows' if dim == self.values.ndim - 2 else 'columns'} {start}..{end} of "
                             f"an FP8 weight of shape {tuple(self.values.shape)}: they split its {b}-wide scale "
                             "blocks (tensor-parallel shards and packed projections must be whole blocks)")
        return BlockFp8Tensor(self.values.narrow(dim, start, length),
                              self.scale_inv.narrow(dim, start // b, -(-length // b)), self.block)

    def chunk(self, chunks: int, dim: int) -> list["BlockFp8Tensor"]:
        size = self.values.shape[dim] // chunks
        return [self.narrow(dim, i * size, size) for i in range(chunks)]


def as_fp8(loaded: torch.Tensor | BlockFp8Tensor, block: tuple[int, int]) -> BlockFp8Tensor:
    """A loaded weight in the FP8 format: as it is, or quantized now (--quantization fp8)."""
    if isinstance(loaded, BlockFp8Tensor):
        if loaded.block != block:
            raise ValueError(f"FP8 weight has blocks {loaded.block}, the layer expects {block}")
        return loaded
    return BlockFp8Tensor(*quantize_blocks(loaded, block), block)


def as_dense(loaded: torch.Tensor | BlockFp8Tensor, dtype: torch.dtype, quant: Fp8Config | None) -> torch.Tensor:
    """A loaded weight as the full-precision values the layer computes with: an FP8 weight
    dequantized; a full-precision one as it is, or through FP8 and back when the layer is
    quantized (so the CPU computes with the values a GPU would hold)."""
    if isinstance(loaded, BlockFp8Tensor):
        return loaded.dequantize(dtype)
    if quant is not None:
        return as_fp8(loaded, quant.block).dequantize(dtype)
    return loaded


@torch.no_grad()
def fill_random_fp8_(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     generator: torch.Generator, std: float) -> None:
    """Random normal(0, std) bfloat16 weights, quantized into values [..., rows, cols] and their
    scales; drawn a few blocks of rows at a time (quantize_rows_)."""
    def draw(start: int, rows: int) -> torch.Tensor:
        return torch.empty(rows, values.shape[-1], dtype=torch.bfloat16, device=values.device).normal_(
            0.0, std, generator=generator)

    flat_values, flat_scales = values.view(-1, *values.shape[-2:]), scale_inv.view(-1, *scale_inv.shape[-2:])
    for matrix, scales in zip(flat_values, flat_scales):
        quantize_rows_(matrix, scales, block, draw)


def quantize_rows_(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   rows_of: Callable[[int, int], torch.Tensor]) -> None:
    """Fills values [rows, cols] (FP8) and their block scales by quantize_blocks, a few blocks of rows at
    a time: rows_of(start, count) gives those rows in full precision, so no full-precision copy of a large
    weight exists at once."""
    step = block[0] * max(1, (1 << 24) // (block[0] * values.shape[-1]))
    for start in range(0, values.shape[0], step):
        q, s = quantize_blocks(rows_of(start, min(step, values.shape[0] - start)), block)
        values[start:start + q.shape[0]].copy_(q)
        scale_inv[start // block[0]:start // block[0] + s.shape[0]].copy_(s)
