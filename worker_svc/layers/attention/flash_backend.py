"""Attention through flash-attn 2 (the production path on NVIDIA GPUs where it is installed).

Mixed prefill/decode batches: flash_attn_varlen_func over the paged cache (block_table), whose
causal mask is aligned to the bottom right, i.e. query i of a request sees its keys 0..
seq_len - query_len + i, as base.py requires. Pure decode: flash_attn_with_kvcache, which reads
lengths from device tensors only and so can be captured in a CUDA graph.
flash-attn 2 needs the cache's block size to be a multiple of 256. New K/V are written with this
project's Triton store kernel (flash-attn has no standalone one; triton ships wherever it runs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.layers.attention.triton_kernels import store_kv_cache

PAGE_MULTIPLE = 256


class FlashAttentionBackend:
    name = "flash_attn"
    supports_cuda_graphs = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        block_size = k_cache.shape[1]
        if block_size % PAGE_MULTIPLE:
            raise ValueError(f"flash_attn needs a KV block size that is a multiple of {PAGE_MULTIPLE}, not {block_size}")
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_pure_decode:
            out = flash_attn_with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables, softmax_scale=scale, causal=True,
            )
            return out.squeeze(1)
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale, causal=True, block_table=meta.block_tables,
        )
