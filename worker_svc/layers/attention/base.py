"""The contract between the model and its attention backends.

Every backend computes, for a batch that mixes prefill chunks and decodes, causal attention of
each request's new query tokens over that request's whole context in the paged KV cache:
query token i of a request (position seq_len - query_len + i) attends keys at positions
0..that position. Before attending, the backend writes the step's new keys/values into the
cache at `slot_mapping` (slot = block_id * block_size + offset_in_block).

Cache layout (FlashAttention's paged layout): k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim], each contiguous. Any block size. The cache holds finite values everywhere (kv_cache.py
zeroes it; later a slot holds old K/V): a backend may load the rows of a request's last block
past its length, and must mask them (FlashAttention-4 does, when it loads whole pages by TMA).

The cache's element type may differ from the model's (kv_quant.py): an FP8 cache comes with its
layer's KVScales, and a backend that cannot read one says so (`reads_fp8_kv = False`), so the
worker never selects it for an FP8 cache. `attend` is the attention alone, for callers that
stored the step's K/V themselves (rotary.attend_qkv's fused kernel does, on CUDA).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from worker_svc.layers.attention.kv_quant import KVScales

if TYPE_CHECKING:
    from worker_svc.layers.attention.decode_qk import DecodeQK


# Pure-decode steps of at least this many requests hand their attention programs out longest context
# first: with contexts of 100-2048 tokens a 256-request launch ran at 91% of the copy rate against 96%
# for equal contexts, its longest programs ending the launch alone (PERF_NOTES v40). Measured on an
# H100 (v42): that launch 1.9% faster, equal contexts unchanged, the service 75.5% -> 76.4% of its
# floor. The order became global only once a request's kv heads started together (v44,
# triton_kernels.DECODE_HEADS_FIRST): the ragged launch -3.8% more, the service 76.4% -> 79.0%.
# WORKER_ATTENTION_LONGEST_FIRST=0 turns it off; its sort is captured in the decode graphs.
LONGEST_FIRST_MIN_BATCH = int(os.environ.get("WORKER_ATTENTION_LONGEST_FIRST", "64"))


def longest_first(num_requests: int) -> bool:
    """Whether a pure-decode step of num_requests requests attends longest context first."""
    return 0 < LONGEST_FIRST_MIN_BATCH <= num_requests


def longest_first_order(seq_lens: torch.Tensor) -> torch.Tensor:
    """The requests of a pure-decode step, longest context first (int32), on seq_lens' device."""
    return torch.argsort(seq_lens, descending=True).to(torch.int32)


@dataclass
class AttentionMetadata:
    # Per token of the step (num_tokens entries), on the model's device.
    slot_mapping: torch.Tensor      # int64 [num_tokens]: where each new token's K/V goes; -1: skip
    # Per request (batch entries), on the model's device.
    query_start_loc: torch.Tensor   # int32 [batch + 1]: cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor          # int32 [batch]: context length after this step (cached + new)
    block_tables: torch.Tensor      # int32 [batch, max_blocks_per_seq]: padded with 0 past the end
    # Host-side facts, so backends never synchronise with the device to learn them.
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def is_pure_decode(self) -> bool:
        """Every request computes exactly one token (the CUDA-graph case)."""
        return self.max_query_len == 1

    @functools.cached_property
    def decode_order(self) -> torch.Tensor | None:
        """A pure-decode step's requests, longest context first (int32 [batch]), for a kernel that
        hands its programs out in that order (`longest_first`); None for smaller or mixed steps,
        and while LONGEST_FIRST_MIN_BATCH is 0 (off). Computed on the device when first asked, by the
        first layer's attention, and kept for the step's other layers: inside a CUDA-graph capture
        the sort is recorded into the graph and reruns at every replay. A metadata object is built
        per step (and per capture), never reused."""
        if not self.is_pure_decode or not longest_first(self.seq_lens.shape[0]):
            return None
        return longest_first_order(self.seq_lens)


class AttentionBackend(Protocol):
    name: str
    # Its pure-decode forward reads lengths only from the metadata's device tensors, never from
    # the host lists, so a CUDA graph of it replays correctly with other lengths.
    supports_cuda_graphs: bool
    # Its mixed (prefill and decode) path too reads lengths only from device tensors and takes padding
    # requests (no query token, seq_len 0) and padding tokens (slot -1, in no request): the other
    # steps' CUDA graphs (worker_svc/mixed_graphs.py) can capture it.
    supports_mixed_graphs: bool
    # The KV block sizes it takes are the multiples of this (1: any).
    block_size_multiple: int
    reads_fp8_kv: bool           # it can read a float8_e4m3fn cache (with KVScales)
    # Its pure-decode launch can take the packed qkv projection as it left the projection and do Qwen3's q/k
    # norm, RoPE and the K/V store itself (`attend_decode_qk`, attention/decode_qk.py); False: the caller does.
    fuses_decode_qk: bool

    def variant_request_counts(self, num_kv_heads: int, max_requests: int, kv_fp8: bool,
                               device: torch.device) -> tuple[Sequence[int], Sequence[int]]:
        """(pure-decode, mixed) request counts at which its kernels take other compile-time
        constants (a launch config, a split-K factor chosen by the batch's size): the start-up
        warm-up runs one step at each, so that no step of any size compiles after start-up."""
        ...

    def forward(
        self,
        q: torch.Tensor,        # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,   # required when the cache is FP8
    ) -> torch.Tensor:          # [num_tokens, num_heads, head_dim]
        """Stores the step's K/V at meta.slot_mapping, then attends."""
        ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        """Attention over a cache that already holds the step's K/V."""
        ...

    def attend_decode_qk(self, q: torch.Tensor, qk: "DecodeQK", k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        """A pure-decode step's attention from the raw projection (q its q part, qk the rest): the q/k
        norm, RoPE and K/V store, then attention. Only where fuses_decode_qk."""
        ...
