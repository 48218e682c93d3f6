"""The attention module of a decoder layer: binds one layer's KV cache (and, for an FP8 cache,
its scales) to a backend."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from worker_svc.layers.attention.base import AttentionBackend, AttentionMetadata
from worker_svc.layers.attention.kv_quant import KVScales

if TYPE_CHECKING:
    from worker_svc.layers.attention.decode_qk import DecodeQK


class PagedAttention(nn.Module):
    def __init__(self, backend: AttentionBackend, scale: float) -> None:
        super().__init__()
        self.backend = backend
        self.scale = scale
        # Views into the runner's one KV-cache tensor, bound once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # This layer's FP8 scales (worker_svc/kv_cache_scales.py); None for an unquantized cache.
        self.kv_scales: KVScales | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Stores the step's K/V in this layer's cache, then attends."""
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attends over this layer's cache, which already holds the step's K/V."""
        return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)

    def attend_decode_qk(self, q: torch.Tensor, qk: "DecodeQK", meta: AttentionMetadata) -> torch.Tensor:
        """A pure-decode step from the raw projection: the backend stores its K/V and attends
        (backend.fuses_decode_qk)."""
        return self.backend.attend_decode_qk(q, qk, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
