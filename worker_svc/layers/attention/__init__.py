"""Attention backends (torch, Triton, FlashAttention-4), their registry, and the start-up choice
of one (selection.py: by name, or the fastest that runs on this device for the model's shapes)."""
from __future__ import annotations

from worker_svc.layers.attention.base import AttentionBackend, AttentionMetadata
from worker_svc.layers.attention.kernel_cache import configure_kernel_cache
from worker_svc.layers.attention.registry import BACKEND_NAMES, get_attention_backend
from worker_svc.layers.attention.selection import AttentionShape, select_attention_backend
from worker_svc.layers.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend", "AttentionMetadata", "AttentionShape", "BACKEND_NAMES", "TorchAttentionBackend",
    "configure_kernel_cache", "get_attention_backend", "select_attention_backend",
]
