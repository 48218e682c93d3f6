"""Pure-torch paged attention: the reference every other backend is checked against.

Writes the step's K/V into the cache, then for each request gathers its blocks and runs SDPA
with a causal mask shifted by the cached prefix. One SDPA call per request keeps it obviously
correct; it is the CPU path, not a fast one. An FP8 cache is quantized on store and
dequantized on read (kv_quant.py), exactly as the Triton kernels store it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.layers.attention.kv_quant import KVScales, from_cache, to_cache


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """Stores each token's K/V at its slot (block_id * block_size + offset); slot -1 is padding."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for new, cache, inv in ((k, k_cache, "k_inv"), (v, v_cache, "v_inv")):
        values = to_cache(new[keep], cache.dtype, kv_scales, inv)
        if values.element_size() == 1:   # index_copy_ has no float8 kernel; the bytes are the same
            cache, values = cache.view(torch.uint8), values.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, values)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one request: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [query_len, H, D] are the last query_len positions of the context k, v [seq_len, Hkv, D]."""
    query_len, seq_len = q.shape[0], k.shape[0]
    # Query i sits at position seq_len - query_len + i and sees keys up to and including it.
    mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - query_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


class TorchAttentionBackend:
    name = "torch"
    # Reads AttentionMetadata's host lists: a captured graph would replay stale lengths.
    supports_cuda_graphs = False
    supports_mixed_graphs = False
    fuses_decode_qk = False
    reads_fp8_kv = True
    block_size_multiple = 1

    def variant_request_counts(self, num_kv_heads: int, max_requests: int, kv_fp8: bool,
                               device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (), ()   # nothing it compiles depends on the batch's size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        return self.attend(q, k_cache, v_cache, meta, scale, kv_scales)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            block_table = meta.block_tables[i]
            keys = from_cache(gather_context(k_cache, block_table, seq_len), q.dtype, kv_scales, "k")
            values = from_cache(gather_context(v_cache, block_table, seq_len), q.dtype, kv_scales, "v")
            out[start:start + query_len] = causal_attention(q[start:start + query_len], keys, values, scale)
            start += query_len
        return out
