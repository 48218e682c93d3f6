"""The attention backends by name, and loading one.

The accelerated backends live in their own modules and are imported only when asked for, so a
machine without Triton or FlashAttention-4 never imports them. Which one a worker uses is
decided in selection.py ("auto": the fastest by measurement).
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from worker_svc.layers.attention.base import AttentionBackend

# name -> (module, class); modules other than torch's may be absent from an installation.
_BACKENDS = {
    "flash_attn": ("worker_svc.layers.attention.flash_backend", "FlashAttentionBackend"),
    "triton": ("worker_svc.layers.attention.triton_backend", "TritonAttentionBackend"),
    "torch": ("worker_svc.layers.attention.torch_backend", "TorchAttentionBackend"),
}
BACKEND_NAMES = ("auto", *_BACKENDS)
# What "auto" measures on CUDA. torch is the reference, a loop of SDPA calls per request that
# no CUDA graph can hold: it is only the fallback when neither of these runs.
CUDA_CANDIDATES = ("flash_attn", "triton")


def load_backend(name: str) -> AttentionBackend:
    """The backend `name`; raises whatever its import or constructor raises (ImportError when
    its package is missing, RuntimeError when this device cannot run it)."""
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)()


def get_attention_backend(name: str, device: torch.device | str,
                          load: Callable[[str], AttentionBackend] = load_backend) -> AttentionBackend:
    """The backend called `name` ("flash_attn", "triton" or "torch") for `device`; ValueError,
    naming the reason, when it cannot run there. ("auto" is selection.select_attention_backend's.)"""
    device = torch.device(device)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    if name != "torch" and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, not {device}")
    try:
        return load(name)
    except Exception as exc:  # ImportError, or the device cannot run it
        raise ValueError(f"attention backend {name!r} is not available: {describe_error(exc)}") from exc


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """One line for a log: the exception's type and the first line of its message."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
