"""Attention through FlashAttention-4 (`flash_attn.cute`, PyPI flash-attn-4): CuTe DSL kernels,
compiled at run time (no build step), for Hopper (sm90) and Blackwell (sm100) GPUs.

Every step, mixed or pure decode, is one `flash_attn_varlen_func` call over the worker's paged
cache, which is already FlashAttention's paged layout ([num_blocks, block_size, kv_heads,
head_dim], see base.py): page_table = block_tables, seqused_k = seq_lens (context after this
step), cu_seqlens_q = query_start_loc, causal. FlashAttention aligns the causal mask to the bottom
right, so query i of a request sees keys 0..seq_len - query_len + i, as base.py requires.
New K/V are written first by the project's Triton store kernel (FlashAttention-4 has none; Triton
ships with every CUDA build of torch).

Any block size works. A block of exactly the kernel's key tile (128 for head_dim 128 on sm90)
lets it load pages by TMA; other sizes take its cp.async path. With TMA pages the kernel loads a
request's whole last page and masks the rows past its length: the cache must hold finite values
there, which it does (kv_cache.py zeroes it; later contents are old K/V).

CUDA graphs: the call reads lengths only from device tensors; its host-side inputs (tensor
shapes, max_query_len, which is 1 for every decode) are the same at every replay of a captured
batch size. What differs between compiled variants (pure decode or not, batches over 256 rows)
is compiled during the worker's warm-up, before any capture (selection.warm_up_backend).

Compiled kernels are cached on disk by FlashAttention-4 itself (one folder per source
fingerprint, so an upgrade never loads a stale kernel), in the folder kernel_cache.py names
(the worker's --kernel-cache-dir; by default ~/.cache/qwen3-serve/kernels/flash_attn_cute). It
reads that setting when flash_attn.cute is first imported, so the import comes after it.

FP8 KV cache: not read (its paged varlen forward takes no K/V descale in 4.0.0b36), so
`reads_fp8_kv = False` and the worker's start-up selection skips it for --kv-cache-dtype fp8.
"""
from __future__ import annotations

import torch

from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.layers.attention.kernel_cache import apply_default_kernel_cache
from worker_svc.layers.attention.kv_quant import KVScales

apply_default_kernel_cache()
from flash_attn.cute import flash_attn_varlen_func  # noqa: E402  (reads the cache setting)

from worker_svc.layers.attention.triton_kernels import store_kv_cache  # noqa: E402

# Compute capability majors whose FlashAttention-4 forward takes a page table (sm80 and sm120
# kernels assert page_table is None in 4.0.0b36).
PAGED_KV_ARCHS = (9, 10, 11)


class FlashAttentionBackend:
    name = "flash_attn"
    supports_cuda_graphs = True
    supports_mixed_graphs = False   # its varlen launch takes the step's longest query from the host
    block_size_multiple = 1
    fuses_decode_qk = False
    reads_fp8_kv = False

    def variant_request_counts(self, num_kv_heads: int, max_requests: int, kv_fp8: bool,
                               device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (), ()   # nothing it compiles depends on the batch's size

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("flash_attn needs a CUDA device")
        major, minor = torch.cuda.get_device_capability()
        if major not in PAGED_KV_ARCHS:
            raise RuntimeError(f"flash_attn (FlashAttention-4) has paged KV on sm90 and sm100 only, "
                               f"not on this sm{major}{minor} GPU")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        self._check_cache(q, k_cache, v_cache)
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale, kv_scales)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        self._check_cache(q, k_cache, v_cache)
        out, _lse = flash_attn_varlen_func(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
            seqused_k=meta.seq_lens, page_table=meta.block_tables,
            softmax_scale=scale, causal=True,
        )
        return out

    @staticmethod
    def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        # A strided cache view would make the wrapper copy the whole cache on every call.
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("flash_attn needs contiguous per-layer K/V caches")
        if k_cache.dtype != q.dtype:
            raise ValueError(f"flash_attn reads only a KV cache of the model's dtype ({q.dtype}), not {k_cache.dtype}")
