"""The pure-torch paged attention backend against dense causal attention, and the registry."""
from __future__ import annotations

import math

import pytest
import torch

from tests.support.worker_batches import paged_metadata, random_block_tables
from worker_svc.layers.attention import TorchAttentionBackend, get_attention_backend


def dense_causal_attention(q, k, v, scale):
    """Independent reference: explicit softmax(QK^T) with GQA heads repeated and the causal
    diagonal shifted by the cached prefix. q [Lq, H, D], k/v [Lk, Hkv, D]."""
    query_len, seq_len = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(query_len).unsqueeze(1) + (seq_len - query_len)
    scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 2, 16), (8, 1, 4), (2, 2, 8)])
@pytest.mark.parametrize("draw", range(3))
def test_matches_dense_attention_on_random_paged_batches(num_heads, num_kv_heads, block_size, draw):
    g = torch.Generator().manual_seed(1000 * draw + num_heads * 10 + block_size)
    head_dim, num_blocks, batch = 16, 96, 5
    seq_lens = torch.randint(1, 70, (batch,), generator=g).tolist()
    # Mixed query lengths: a decode, a whole prompt, and chunks over cached prefixes.
    query_lens = [1, seq_lens[1]] + [int(torch.randint(1, s + 1, (1,), generator=g)) for s in seq_lens[2:]]
    tables = random_block_tables(seq_lens, block_size, num_blocks, g)
    meta = paged_metadata(tables, seq_lens, query_lens, block_size)

    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    contexts = [(torch.randn(s, num_kv_heads, head_dim, generator=g), torch.randn(s, num_kv_heads, head_dim, generator=g))
                for s in seq_lens]
    for (k, v), table, seq_len, query_len in zip(contexts, tables, seq_lens, query_lens):
        for pos in range(seq_len - query_len):   # the cached prefix is already in the cache
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    new_k = torch.cat([k[s - ql:] for (k, _), s, ql in zip(contexts, seq_lens, query_lens)])
    new_v = torch.cat([v[s - ql:] for (_, v), s, ql in zip(contexts, seq_lens, query_lens)])
    scale = 1 / math.sqrt(head_dim)

    out = TorchAttentionBackend().forward(q, new_k, new_v, k_cache, v_cache, meta, scale)

    start = 0
    for (k, v), query_len in zip(contexts, query_lens):
        expected = dense_causal_attention(q[start:start + query_len], k, v, scale)
        torch.testing.assert_close(out[start:start + query_len], expected, atol=1e-5, rtol=1e-5)
        start += query_len
    # The step's new K/V landed at their slots.
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[meta.slot_mapping], new_k, atol=0, rtol=0)


def test_padding_slots_are_not_written():
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    meta = paged_metadata([[1]], [2], [2], block_size=4)
    meta.slot_mapping[0] = -1   # e.g. a padded row of a CUDA-graph batch
    k, v, q = torch.ones(2, 1, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8)
    TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale=1.0)
    assert k_cache[1, 0].abs().sum() == 0 and k_cache[1, 1].abs().sum() == 8
    assert k_cache[0].abs().sum() == 0


def test_registry_loads_torch_on_cpu_and_rejects_unusable_names():
    # "auto" is selection.select_attention_backend's (tests/test_attention_selection.py).
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nonesuch", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("triton", "cpu")
