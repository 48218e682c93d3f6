"""Sizing and allocating the paged KV cache: one tensor [2 (k, v), layers, blocks, block_size,
kv_heads, head_dim] of the cache's element type (--kv-cache-dtype: the model's, bfloat16, or FP8
at one byte an element, so the same memory holds twice the blocks of bfloat16), whose per-layer
views the attention modules hold."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# CPU default: 1 GiB worth, but never more blocks than this, so a tiny test model does not zero
# a gigabyte per worker process (4096 blocks of 16 tokens = 64k tokens of context).
_CPU_DEFAULT_GIB = 1.0
_CPU_DEFAULT_MAX_BLOCKS = 4096


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one block across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def blocks_for_memory(gib: float, bytes_per_block: int) -> int:
    return int(gib * _GIB) // bytes_per_block


def cpu_default_blocks(bytes_per_block: int) -> int:
    return min(blocks_for_memory(_CPU_DEFAULT_GIB, bytes_per_block), _CPU_DEFAULT_MAX_BLOCKS)


def cuda_free_blocks(device: torch.device, bytes_per_block: int, utilization: float) -> int:
    """Blocks that fit in `utilization` of the device after a warm-up forward: what other users
    and this process already hold stays, and room for the warm-up's activation peak is kept."""
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    activation_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    budget = total * utilization - (total - free) - activation_peak
    return max(int(budget) // bytes_per_block, 0)


def allocate_kv_cache(model: torch.nn.Module, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocates the cache (zeroed, so no backend can ever read NaN garbage) and binds each
    attention layer to its slice."""
    layers = model.attention_layers()
    cache = torch.zeros(2, len(layers), num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache


def unbind_kv_cache(model: torch.nn.Module) -> None:
    """Drops the layers' views so the cache's memory can be freed."""
    for layer in model.attention_layers():
        layer.k_cache = layer.v_cache = torch.empty(0)
