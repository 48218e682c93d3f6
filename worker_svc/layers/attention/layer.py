"""The attention module of a decoder layer: binds one layer's KV cache to a backend."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.layers.attention.base import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, backend: AttentionBackend, scale: float) -> None:
        super().__init__()
        self.backend = backend
        self.scale = scale
        # Views into the runner's one KV-cache tensor, bound once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
