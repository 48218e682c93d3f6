"""Hand-built paged batches for the worker's model and attention tests.

A request is described by its final context length and how many of those tokens it computes
this step; its blocks are drawn at random from the cache, so no test relies on blocks being
contiguous or ordered.
"""
from __future__ import annotations

import dataclasses

import torch

from worker_svc.layers.attention.base import AttentionMetadata


def random_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                        generator: torch.Generator) -> list[list[int]]:
    """Distinct random blocks for each request, enough for its whole context."""
    needed = [-(-s // block_size) for s in seq_lens]
    assert sum(needed) <= num_blocks, "cache too small for the batch"
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start:start + n])
        start += n
    return tables


def paged_metadata(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
                   block_size: int) -> AttentionMetadata:
    """Metadata for computing the last query_lens[i] tokens of request i's seq_lens[i]."""
    slots = []
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens):
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(-(-s // block_size) for s in seq_lens)
    padded = [table[:-(-s // block_size)] + [0] * (width - -(-s // block_size)) for table, s in zip(block_tables, seq_lens)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


def metadata_on(meta: AttentionMetadata, device) -> AttentionMetadata:
    """The same metadata with its tensors on `device`."""
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if torch.is_tensor(getattr(meta, f.name))})


def positions_of(seq_lens: list[int], query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([p for s, q in zip(seq_lens, query_lens) for p in range(s - q, s)], dtype=torch.int64)


def tiny_qwen3_with_cache(model_dir, dtype: torch.dtype, device: torch.device, num_blocks: int = 32,
                          block_size: int = 8):
    """The checkpoint's Qwen3ForCausalLM built in `dtype` (as the model runner builds it: the RoPE
    table stays float32) on `device`, over the torch attention backend, with a KV cache."""
    from worker_svc import kv_cache
    from worker_svc.layers.attention import TorchAttentionBackend
    from worker_svc.loader import load_safetensors
    from worker_svc.model_config import load_model_config
    from worker_svc.models.qwen3 import Qwen3ForCausalLM

    config = load_model_config(model_dir)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config, TorchAttentionBackend()).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    load_safetensors(model, model_dir)
    kv_cache.allocate_kv_cache(model, num_blocks, block_size, config.num_key_value_heads, config.head_dim,
                               dtype, device)
    return model
