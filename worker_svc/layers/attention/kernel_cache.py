"""Where compiled attention kernels live on disk, so that a restarted worker loads them instead
of compiling them again (FlashAttention-4 compiles each kernel variant for seconds).

FlashAttention-4 keeps its own disk cache, switched on and placed by two environment variables
that it reads once, when flash_attn.cute is first imported; this module sets them. Triton keeps
its cache where it always does (TRITON_CACHE_DIR, else ~/.triton/cache).
"""
from __future__ import annotations

import logging
import os
import pathlib
import sys

logger = logging.getLogger(__name__)

FA4_CACHE_ENABLED_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
FA4_CACHE_DIR_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
FA4_SUBDIR = "flash_attn_cute"


def default_kernel_cache_dir() -> pathlib.Path:
    """$XDG_CACHE_HOME/qwen3-serve/kernels, by default ~/.cache/qwen3-serve/kernels."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache_home) / "qwen3-serve" / "kernels"


def configure_kernel_cache(path: str | os.PathLike | None) -> pathlib.Path:
    """Puts the compiled-kernel cache under `path` (None: default_kernel_cache_dir()) and returns
    FlashAttention-4's folder there. Call it before any backend loads: once flash_attn.cute is
    imported, its cache stays where it was (a warning says so)."""
    fa4_dir = (pathlib.Path(path).expanduser() if path else default_kernel_cache_dir()) / FA4_SUBDIR
    if "flash_attn.cute" in sys.modules and os.environ.get(FA4_CACHE_DIR_ENV) != str(fa4_dir):
        logger.warning("flash_attn.cute is already imported: its compiled kernels stay in %s, not %s",
                       os.environ.get(FA4_CACHE_DIR_ENV, "its default"), fa4_dir)
    os.environ[FA4_CACHE_ENABLED_ENV] = "1"
    os.environ[FA4_CACHE_DIR_ENV] = str(fa4_dir)
    return fa4_dir


def apply_default_kernel_cache() -> None:
    """What importing the flash_attn backend does first: the disk cache on, in the configured
    folder or, when nothing configured one, the default (an environment that already names
    one keeps it)."""
    os.environ.setdefault(FA4_CACHE_ENABLED_ENV, "1")
    os.environ.setdefault(FA4_CACHE_DIR_ENV, str(default_kernel_cache_dir() / FA4_SUBDIR))
