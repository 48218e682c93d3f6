"""RMSNorm, computed like transformers' Qwen3RMSNorm so half-precision results match it."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, into=None):
        """norm(x); with `residual`, (norm(x + residual), x + residual): the sum is the next
        residual, so a decoder layer's residual add and its norm are one step (one kernel on CUDA).
        `into`: the linear layer that takes norm(x); where it takes its input quantized to FP8
        (linear.py's quant_group), norm(x) comes quantized for it, from the same kernel; where it
        computes the norm itself (linear.py's takes_norm: a GEMV of a few rows), norm(x) comes as
        a linear_methods.NormedInput for it, and x + residual is written by that layer's kernel
        into the tensor returned here (which nothing reads before the layer has run)."""
        if into is not None and into.takes_norm(x.numel() // x.shape[-1]):
            from worker_svc.layers.gemv_kernels import FoldedNorm   # imports Triton
            from worker_svc.layers.linear_methods import NormedInput

            if residual is None:
                return NormedInput(x, FoldedNorm(self.weight, self.eps))
            total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            return NormedInput(x, FoldedNorm(self.weight, self.eps, residual, total)), total
        if x.is_cuda:
            from worker_svc.layers import fused_kernels   # imports Triton, which CUDA installs have

            if fused_kernels.ENABLED:
                group = (into.quant_group(x.numel() // x.shape[-1])
                         if into is not None and fused_kernels.FP8_QUANT_FUSION else None)
                if group is not None:
                    return fused_kernels.rms_norm_fp8(x, self.weight, self.eps, residual, group)
                return fused_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        total = x + residual   # in the model dtype, as the reference adds
        return self._norm(total), total

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch: statistics in float32, cast back before the weight multiply, as the
    reference does (the fused kernels' and the folded GEMVs' reference)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
