"""Attention through this project's Triton kernels (triton_kernels.py): the GPU path when
flash-attn is not installed. Mixed prefill/decode batches take one varlen launch; pure-decode
batches take the split-K decode launch, whose shape depends only on the batch size, so it can be
captured in a CUDA graph; it also takes a pure-decode step's raw qkv projection and does the q/k
norm, RoPE and K/V store itself (decode_qk.py). Reads bfloat16, float32 and FP8 caches."""
from __future__ import annotations

import torch

from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.layers.attention.decode_qk import DecodeQK
from worker_svc.layers.attention.kv_quant import KVScales
from worker_svc.layers.attention.triton_kernels import decode_variant_counts, paged_attention, store_kv_cache


class TritonAttentionBackend:
    name = "triton"
    # Reads lengths only from device tensors, never from AttentionMetadata's host lists.
    supports_cuda_graphs = True
    # ... in mixed batches too: its grids are bounds from the shapes, and programs past the step's
    # tokens or of padding requests return at once.
    supports_mixed_graphs = True
    block_size_multiple = 1
    reads_fp8_kv = True
    fuses_decode_qk = True

    def variant_request_counts(self, num_kv_heads: int, max_requests: int, kv_fp8: bool,
                               device: torch.device) -> tuple[list[int], list[int]]:
        return decode_variant_counts(num_kv_heads, max_requests, kv_fp8, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        return self.attend(q, k_cache, v_cache, meta, scale, kv_scales)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               scale, pure_decode=meta.is_pure_decode, kv_scales=kv_scales,
                               decode_order=meta.decode_order)

    def attend_decode_qk(self, q: torch.Tensor, qk: DecodeQK, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        assert meta.is_pure_decode
        return paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               scale, pure_decode=True, kv_scales=kv_scales, decode_order=meta.decode_order, qk=qk)
