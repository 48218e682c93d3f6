"""CUDA graphs for pure-decode steps.

A decode step of a small model is dozens of short kernels per layer; launching them one by one
from Python costs more than running them. So the model's forward is captured once per padded
batch size (1, 2, 4, 8, then every multiple of 16) and a decode step replays the smallest graph
that fits, with the padding rows made inert (slot -1: their K/V are not stored; seq_len 0: they
attend to nothing). Two ways in:
- `run`: the step's input tensors are copied into the static buffers, then the graph replays.
- `replay` (given DecodeInputs): the host has staged the step's columns where the graph reads
  them (graph_inputs.py), and the graph's first kernel unpacks them; with a `sample` body, a
  second graph per size takes the hidden states through the LM head and the device sampler
  (`replay_sample`), so a decode step launches the two replays and nothing else. The sampling
  graphs are captured again when the sampler's tensors were reallocated (its `graph_key`). A
  speculating worker stages its decode-shaped steps too (a verification's tokens as decode rows)
  and samples outside the graphs; graphs given DecodeInputs are never `run`.
- `inputs_of` another DecodeGraphs: graphs of a second forward over the same step (a draft model's
  catch-up) read that one's static inputs, so after its `run` the second replays with no copies.

Only backends whose pure-decode path reads lengths from device tensors can be captured (their
`supports_cuda_graphs`, an attribute of the backend protocol in layers/attention/base.py); a
backend that reads AttentionMetadata's host lists would replay the lengths it saw at capture time.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import numpy as np
import torch

from worker_svc.graph_inputs import DecodeInputs
from worker_svc.layers.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

# Beyond this many requests a decode step is dominated by its matmuls and attention, not by
# launch overhead, and the graphs' static buffers would only grow.
MAX_GRAPH_BATCH_SIZE = 512

# -> hidden states, or (hidden states, further per-token outputs: eagle3's aux hidden states)
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata],
                   torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]]
# (hidden states [n, ...], rows [n], tokens out [n], logprobs out [n]) -> None
Sample = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def capture_largest_first(sizes: list[int], warm_up: Callable[[int], object], captured: Callable[[int], object], *,
                          release_warm_up: bool = False) -> dict[int, torch.cuda.CUDAGraph]:
    """One graph per size, all in one new memory pool, the largest first (the smaller then fit in the memory it
    took). Each size's `warm_up` runs eagerly just before its capture (Triton compiles, cuBLAS plans outside
    the capture); with release_warm_up, the general pool's free memory goes back to the device between them
    (for a warm-up as large as the graph, which the graph's pool takes as much again). `captured(size)` is
    what the graph holds."""
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    for size in reversed(sizes):
        warm_up(size)
        if release_warm_up:
            torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            captured(size)
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, 16, 32, 48, ... up to max_batch_size, which is
    always included so every batch the scheduler may send has a graph."""
    cap = min(max_batch_size, MAX_GRAPH_BATCH_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s < cap] + list(range(16, cap, 16))
    return sizes + [cap]


class DecodeGraphs:
    """Captured forwards for pure-decode batches of up to `max_batch_size` requests.

    `forward(input_ids, positions, meta)` must return a fresh [num_tokens, ...] tensor (hidden
    states), or that and a list of further [num_tokens, ...] tensors (`aux` returns them after a
    replay), and must only read the metadata's device tensors. Capture happens in the
    constructor, after the KV cache is allocated and bound (the graphs read its addresses)."""

    def __init__(self, forward: Forward, *, max_batch_size: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device, inputs: DecodeInputs | None = None,
                 sample: Sample | None = None, sample_key: Callable[[], tuple] | None = None,
                 inputs_of: DecodeGraphs | None = None) -> None:
        if sample is not None and inputs is None:
            raise ValueError("sampling inside the graphs needs staged inputs (their rows and dummy row)")
        self.forward = forward
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.max_model_len = max_model_len
        self.inputs = inputs
        self.sample, self.sample_key = sample, sample_key
        if inputs_of is not None:   # its sizes up to the one that holds max_batch_size, its input buffers
            largest = inputs_of.padded(min(max_batch_size, inputs_of.batch_sizes[-1]))
            self.batch_sizes = [size for size in inputs_of.batch_sizes if size <= largest]
            for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables", "query_start_loc",
                         "rows", "tokens", "logprobs"):
                setattr(self, name, getattr(inputs_of, name))
        else:
            self._allocate_inputs(max_blocks_per_seq, device)
        self.outputs: torch.Tensor | None = None
        self.aux_outputs: list[torch.Tensor] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._sampled_key: tuple | None = None
        self.usable = True   # False once a tensor the graphs read was reallocated under them
        self._capture_all()
        if sample is not None:
            self._capture_sampling()

    def _allocate_inputs(self, max_blocks_per_seq: int, device: torch.device) -> None:
        largest = self.batch_sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(largest, dtype=torch.int64)
            self.positions = torch.zeros(largest, dtype=torch.int64)
            self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64)
            self.seq_lens = torch.zeros(largest, dtype=torch.int32)
            self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32)
            # One query token per request, so the offsets never change.
            self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32)
            self.rows = torch.zeros(largest, dtype=torch.int64)          # staged steps: the rows that sample
            self.tokens = torch.zeros(largest, dtype=torch.int64)        # and what they sampled
            self.logprobs = torch.zeros(largest, dtype=torch.float32)

    @property
    def staged(self) -> bool:
        """Whether a decode step may stage its inputs for `replay` (and sample with `replay_sample`)."""
        return self.inputs is not None and self.usable

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether `run` takes this step (graphs that unpack staged inputs only `replay`)."""
        return (self.usable and self.inputs is None and meta.is_pure_decode
                and meta.seq_lens.shape[0] <= self.batch_sizes[-1])

    def disable(self, why: str) -> None:
        if self.usable:
            logger.warning("decode graphs disabled, decoding eagerly from now on: %s", why)
        self.usable = False

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward's output for this decode batch. The returned tensor is a view of a static
        buffer: read it before the next run."""
        n = input_ids.shape[0]
        padded = self.padded(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:padded].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:padded].zero_()
        # Columns past a request's last block keep stale ids: nothing reads past seq_len.
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[padded].replay()
        return self.outputs[:n]

    def aux(self, n: int) -> list[torch.Tensor]:
        """After a run or replay of n requests: the forward's further outputs (views of static buffers)."""
        return [out[:n] for out in self.aux_outputs]

    def replay(self, n: int) -> torch.Tensor:
        """The forward's output for the decode step of n requests staged in `inputs` (a view of a
        static buffer: read it before the next replay); `rows[:n]` then holds its sampling rows."""
        self.graphs[self.padded(n)].replay()
        return self.outputs[:n]

    def staged_meta(self, seq_lens: np.ndarray, max_seq_len: int) -> AttentionMetadata:
        """The attention metadata of a staged decode step of len(seq_lens) requests, over the static
        buffers its replay writes (read them after it): what an eager pass over the same step reads."""
        n = len(seq_lens)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[:n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],   # columns past a request's blocks: stale, never read
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_cpu=[1] * n,
            seq_lens_cpu=seq_lens.tolist(),
        )

    def replay_sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After `replay(n)`: samples the step's rows; (tokens, logprobs) views of static buffers."""
        if self.sample_key() != self._sampled_key:
            self._capture_sampling()
        self.sample_graphs[self.padded(n)].replay()
        return self.tokens[:n], self.logprobs[:n]

    def padded(self, n: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]

    def _static_meta(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            # Host facts hold for every replay only as bounds; graph-safe backends ignore them.
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * batch_size,
            seq_lens_cpu=[self.max_model_len] * batch_size,
        )

    def _body(self, batch_size: int) -> torch.Tensor:
        """What a forward graph runs: the unpacking of staged inputs, if any, then the forward."""
        if self.inputs is not None:
            self.inputs.unpack(batch_size, self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                               self.rows, self.block_tables)
        return self.forward(self.input_ids[:batch_size], self.positions[:batch_size], self._static_meta(batch_size))

    def _captured(self, batch_size: int) -> None:
        """What a forward graph holds: the body, its outputs written to the static buffers."""
        hidden, aux = _split(self._body(batch_size))
        for static, out in zip((self.outputs, *self.aux_outputs), (hidden, *aux)):
            static[:batch_size] = out

    def _warm_up(self, batch_size: int) -> None:
        """The eager run before a capture (its slots are all -1: the KV cache is left untouched); the first,
        the largest, sizes the static outputs."""
        warm, warm_aux = _split(self._body(batch_size))
        if self.outputs is None:
            self.outputs, *self.aux_outputs = (torch.empty((self.batch_sizes[-1], *t.shape[1:]), dtype=t.dtype,
                                                           device=t.device) for t in (warm, *warm_aux))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.graphs = capture_largest_first(self.batch_sizes, self._warm_up, self._captured)

    @torch.inference_mode()
    def _capture_sampling(self) -> None:
        """The sampling graphs, in a pool of their own (so capturing them again frees the old). Their
        warm-ups run eagerly and draw for the dummy row only: a draw for a row of the staged step
        would advance its counter and count a token into its penalties that it never got."""
        self.sample_graphs.clear()
        staged_rows = self.rows.clone()
        self.rows.fill_(self.inputs.dummy_row)

        def sample(batch_size: int) -> None:
            self.sample(self.outputs[:batch_size], self.rows[:batch_size], self.tokens[:batch_size],
                        self.logprobs[:batch_size])

        self.sample_graphs = capture_largest_first(self.batch_sizes, sample, sample)
        self.rows.copy_(staged_rows)
        self._sampled_key = self.sample_key()


def _split(out: torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A forward's (hidden states, further outputs)."""
    return out if isinstance(out, tuple) else (out, [])
