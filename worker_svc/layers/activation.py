"""SwiGLU activation over a packed [gate | up] projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda:
            from worker_svc.layers import fused_kernels   # imports Triton, which CUDA installs have

            if fused_kernels.ENABLED:
                return fused_kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
