"""The KV cache's element type, and the FP8 format: float8 e4m3 values with a float32 scale per
layer and kv head.

A K or V element x is stored as e4m3(clamp(x * inv_scale, -448, 448)), rounded to nearest even,
where inv_scale = 1 / scale; it reads back as value * scale. Every writer (the torch store, the
Triton store kernels) computes that same float32 product from the model-dtype value, so all of
them store the same bytes. A per-tensor scale is one number repeated for every kv head. Where the
scales come from is worker_svc/kv_cache_scales.py.

An unquantized cache may also differ from the model's dtype (a bfloat16 cache under a float32
model): values are cast on store and on read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)   # 448
_NAMED_DTYPES = {"bfloat16": torch.bfloat16, "fp8": FP8_KV_DTYPE}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: "auto" is the model's dtype; "bfloat16"; "fp8" (e4m3 with scales)."""
    if name == "auto":
        return model_dtype
    if name not in _NAMED_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_NAMED_DTYPES)}; got {name!r}")
    return _NAMED_DTYPES[name]


def is_fp8(cache: torch.Tensor | torch.dtype) -> bool:
    dtype = cache if isinstance(cache, torch.dtype) else cache.dtype
    return dtype == FP8_KV_DTYPE


def dtype_name(dtype: torch.dtype) -> str:
    """How the worker reports its cache's element type: "bfloat16", "float32", "float8_e4m3fn"."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVScales:
    """One layer's FP8 scales, float32 [num_kv_heads] each, on the cache's device: K and V
    elements read back as stored value * scale; `*_inv` are what the writers multiply by."""
    k: torch.Tensor
    v: torch.Tensor
    k_inv: torch.Tensor
    v_inv: torch.Tensor

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> "KVScales":
        k, v = k.float().contiguous(), v.float().contiguous()
        if k.shape != v.shape or k.ndim != 1:
            raise ValueError(f"K and V scales must be two vectors of one scale per kv head, got shapes "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if not (torch.isfinite(k).all() and torch.isfinite(v).all() and (k > 0).all() and (v > 0).all()):
            raise ValueError("KV-cache scales must be finite and positive")
        return cls(k, v, 1.0 / k, 1.0 / v)

    @classmethod
    def ones(cls, num_kv_heads: int, device: torch.device | str) -> "KVScales":
        one = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        return cls.of(one, one)

    def to(self, device: torch.device | str) -> "KVScales":
        return KVScales(*(t.to(device) for t in (self.k, self.v, self.k_inv, self.v_inv)))


def quantize(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """x [tokens, kv_heads, head_dim] (any float dtype) as e4m3, with one inverse scale per head."""
    scaled = x.float() * inv_scale.to(x.device)[:, None]
    return scaled.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 x [tokens, kv_heads, head_dim] times its heads' scales, in float32, then as dtype."""
    return (x.float() * scale.to(x.device)[:, None]).to(dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scales: KVScales | None, inv: str) -> torch.Tensor:
    """x as the cache stores it; `inv` names the inverse scale ("k_inv" or "v_inv")."""
    if is_fp8(cache_dtype):
        if scales is None:
            raise ValueError("an fp8 KV cache needs its layer's scales")
        return quantize(x, getattr(scales, inv))
    return x.to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scales: KVScales | None, scale: str) -> torch.Tensor:
    """Cached x as dtype; `scale` names the scale ("k" or "v")."""
    if is_fp8(x):
        if scales is None:
            raise ValueError("an fp8 KV cache needs its layer's scales")
        return dequantize(x, getattr(scales, scale), dtype)
    return x.to(dtype)
