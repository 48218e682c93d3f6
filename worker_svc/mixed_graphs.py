"""CUDA graphs for the steps that are not pure decode: prefill chunks, alone or beside decodes.

An eager step launches every kernel of every layer from Python (~380 for Qwen3-0.6B's 28 layers),
and on a slow host that takes longer than the kernels run. On an H200 host (PERF_NOTES v52) a
16,384-token step took 36-65 ms to launch for ~35 ms of device work, its device busy 50-89% of the
step, and a lone 964-token prompt took 47 ms to launch for ~3 ms of kernels: its time to first
token was the host's. So the forward is captured once per padded token count (`token_buckets`:
powers of two up to 2,048, then every 2,048 up to the step budget) for up to max_num_seqs requests,
and a step replays the smallest graph that holds its tokens, its inputs copied into the static
buffers and the padding made inert as in the decode graphs (cuda_graphs.py): padding tokens have
slot -1 (their K/V are not stored) and belong to no request; padding requests have no query token
and seq_len 0 (they attend to nothing). No attention program writes a padding token's output, so
its row carries whatever that memory held (inf and NaN included) through the layers; every op after
it is row by row and its K/V are never stored, so it reaches no real token, and nothing reads it.
The padded tokens cost their share of the matmuls: at most 2,048 tokens of a large step, a few
percent of its device time, where the launch it saves is most of its host time.

Only a backend whose mixed path reads every length from device tensors can be captured
(`supports_mixed_graphs`): Triton's (its grids are bounds from the shapes). Dense models on one GPU
without speculation (startup.capture_mixed_graphs says why not, otherwise). Capture follows the
decode graphs' (the attention's split counters are sized by then) and falls back to eager steps
when the memory is not there, or when a small test step (`replay_error`) replays further from the
eager forward than rounding. On by default (an H100, PERF_NOTES v53: the service 76.3-76.8% -> 78.6-78.9% of
its floor, TTFT p50 305-348 -> 264-265 ms); WORKER_MIXED_GRAPHS=0 turns them off.
"""
from __future__ import annotations

import bisect
import itertools
import os
from typing import Callable

import torch

from worker_svc.cuda_graphs import capture_largest_first
from worker_svc.layers.attention.base import AttentionMetadata

ENABLED = os.environ.get("WORKER_MIXED_GRAPHS", "1") != "0"
SMALLEST_BUCKET = 16
# Up to here the buckets double; past it they grow by this many tokens (the most a step pads).
DOUBLING_UP_TO = 2048

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts to capture: 16, 32, ... 2048, then 4096, 6144, ... and max_tokens,
    which is always included so that every step the scheduler may send has a graph."""
    sizes, size = [], SMALLEST_BUCKET
    while size < min(max_tokens, DOUBLING_UP_TO):
        sizes.append(size)
        size *= 2
    size = DOUBLING_UP_TO
    while size < max_tokens:
        sizes.append(size)
        size += DOUBLING_UP_TO
    return sizes + [max_tokens]


class MixedGraphs:
    """Captured forwards for steps of up to max_tokens tokens from up to max_requests requests.
    `forward(input_ids, positions, meta)` must return a fresh [num_tokens, ...] tensor and read only
    the metadata's device tensors. Capture happens in the constructor, after the KV cache is bound."""

    def __init__(self, forward: Forward, *, max_tokens: int, max_requests: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device) -> None:
        self.forward = forward
        self.sizes = token_buckets(max_tokens)
        # A step has at most one request per token.
        self.requests = {size: min(size, max_requests) for size in self.sizes}
        self.max_requests = max_requests
        self.max_model_len = max_model_len
        with torch.device(device):
            self.input_ids = torch.zeros(max_tokens, dtype=torch.int64)
            self.positions = torch.zeros(max_tokens, dtype=torch.int64)
            self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64)
            self.query_start_loc = torch.zeros(max_requests + 1, dtype=torch.int32)
            self.seq_lens = torch.zeros(max_requests, dtype=torch.int32)
            self.block_tables = torch.zeros(max_requests, max_blocks_per_seq, dtype=torch.int32)
        self.outputs: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self._capture_all()

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether a replay takes this step: not a pure decode (the decode graphs' own), and within
        the captured bounds."""
        return (not meta.is_pure_decode and meta.slot_mapping.shape[0] <= self.sizes[-1]
                and meta.seq_lens.shape[0] <= self.max_requests
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward's output for this step (a view of a static buffer: read it before the next run)."""
        n, r = input_ids.shape[0], meta.seq_lens.shape[0]
        size = self.padded(n)
        requests = self.requests[size]
        assert r <= requests, f"{r} requests in a step of {n} tokens"
        # Padding tokens keep the ids and positions of earlier steps (valid ones; nothing reads their outputs).
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.query_start_loc[:r + 1].copy_(meta.query_start_loc)
        self.query_start_loc[r + 1:requests + 1].fill_(n)
        self.seq_lens[:r].copy_(meta.seq_lens)
        self.seq_lens[r:requests].zero_()
        # Columns past a request's last block keep stale ids: nothing reads past seq_len.
        self.block_tables[:r, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[:n]

    def padded(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    @torch.inference_mode()
    def replay_error(self, block_size: int, vocab_size: int) -> float:
        """Start-up's check: a small mixed step (a 5-token prompt chunk beside a decode at position 2; one
        6-token chunk after 3 cached tokens where a step holds one request) on the first KV blocks, run
        eagerly and replayed in the smallest graph, and the relative difference of their outputs. It
        writes K/V into those blocks, which no request holds yet (a request's own tokens overwrite them
        before they are read)."""
        device = self.input_ids.device
        requests = [(5, 5), (3, 1)] if self.max_requests >= 2 else [(9, 6)]   # (seq_len, query tokens)
        tables, slots, positions, first = [], [], [], 0
        for seq_len, query in requests:
            blocks = list(range(first, first + -(-seq_len // block_size)))
            first += len(blocks)
            tables.append(blocks)
            for pos in range(seq_len - query, seq_len):
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
                positions.append(pos)
        width = max(len(t) for t in tables)
        starts = [0, *itertools.accumulate(query for _, query in requests)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([r[0] for r in requests], dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            max_query_len=max(r[1] for r in requests), max_seq_len=max(r[0] for r in requests),
            query_lens_cpu=[r[1] for r in requests], seq_lens_cpu=[r[0] for r in requests])
        input_ids = torch.arange(1, len(slots) + 1, device=device) % vocab_size
        positions = torch.tensor(positions, device=device)
        eager = self.forward(input_ids, positions, meta).double()
        replayed = self.run(input_ids, positions, meta).double()
        self.replays -= 1   # not a step's
        return ((replayed - eager).norm() / eager.norm().clamp_min(1e-30)).item()

    def _static_meta(self, size: int) -> AttentionMetadata:
        requests = self.requests[size]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[:requests + 1],
            seq_lens=self.seq_lens[:requests],
            block_tables=self.block_tables[:requests],
            # Host facts hold for every replay only as bounds (and make it a mixed step: its tokens'
            # attention, not the decode launch); graph-safe backends ignore them.
            max_query_len=size,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[0] * requests,
            seq_lens_cpu=[self.max_model_len] * requests,
        )

    def _captured(self, size: int) -> None:
        """What a graph holds: the forward over the static buffers, its output written to the static one."""
        self.outputs[:size] = self.forward(self.input_ids[:size], self.positions[:size], self._static_meta(size))

    def _warm_up(self, size: int) -> None:
        """The eager run before a capture; the first, the largest, sizes the static output. Warm-ups and
        captures see no request (every query_start_loc 0, every slot -1): the KV cache is left untouched
        and no attention program reads it."""
        warm = self.forward(self.input_ids[:size], self.positions[:size], self._static_meta(size))
        if self.outputs is None:
            self.outputs = torch.empty((self.sizes[-1], *warm.shape[1:]), dtype=warm.dtype, device=warm.device)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # The largest warm-up is as large as its graph: its activations go back to the device before capture.
        self.graphs = capture_largest_first(self.sizes, self._warm_up, self._captured, release_warm_up=True)
