"""Attention backends and the registry that picks one.

The accelerated backends live in their own modules and are imported only when asked for, so
a machine without Triton or flash-attn never imports them; "auto" uses the fastest one that
imports on the device.
"""
from __future__ import annotations

import importlib
import logging

import torch

from worker_svc.layers.attention.base import AttentionBackend, AttentionMetadata
from worker_svc.layers.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

# name -> (module, class); modules other than torch's may be absent from an installation.
_BACKENDS = {
    "flash_attn": ("worker_svc.layers.attention.flash_backend", "FlashAttentionBackend"),
    "triton": ("worker_svc.layers.attention.triton_backend", "TritonAttentionBackend"),
    "torch": ("worker_svc.layers.attention.torch_backend", "TorchAttentionBackend"),
}
# Most preferred first; "auto" takes the first that imports, else torch. Both are CUDA only.
_AUTO_ORDER_CUDA = ("flash_attn", "triton")

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend", "BACKEND_NAMES"]
BACKEND_NAMES = ("auto", *_BACKENDS)


def _load(name: str) -> AttentionBackend:
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)()


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called `name` ("auto", "flash_attn", "triton" or "torch") for `device`.
    An explicitly named backend that cannot load is an error; "auto" falls back to torch."""
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return TorchAttentionBackend()
        for candidate in _AUTO_ORDER_CUDA:
            try:
                return _load(candidate)
            except ImportError as exc:
                logger.info("attention backend %s unavailable (%s)", candidate, exc)
        return TorchAttentionBackend()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name != "torch" and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, not {device}")
    try:
        return _load(name)
    except ImportError as exc:
        raise ValueError(f"attention backend {name!r} is not available: {exc}") from exc
