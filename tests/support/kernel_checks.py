"""How the worker's kernel tests measure a kernel against its reference."""
from __future__ import annotations

import torch

from tests.support.triton_interpreter import INTERPRETED

# An FP8 GEMM against its emulation (activations quantized per token group, weights dequantized,
# products in float32 or wider): float32 rounding under the interpreter; 2^-10 on a GPU, whose FP8
# tensor cores keep about 14 bits while they sum a 128-wide block.
FP8_GEMM_VS_EMULATION = 1e-5 if INTERPRETED else 2 ** -10


def every_e4m3_byte(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """An FP8 (e4m3) tensor of `shape` drawn over every finite e4m3 byte: zeros, subnormals, both
    signs, the largest (the two NaN codes left out)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    return codes[torch.randint(len(codes), shape, generator=generator)].view(torch.float8_e4m3fn)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference over the largest expected magnitude, in float64 on the CPU."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max()).item()
