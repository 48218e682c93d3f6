"""CUDA graphs of a device proposer's drafting passes (eagle3, draft): one graph per padded number
of drafting requests holds all k passes of a step.

Eagerly, each pass is a Python-dispatched forward (a 28-layer draft model is ~400 launches a pass,
~18 ms on an H200 at batch 1 where its device time is ~0.3 ms: PERF_NOTES v18), so the passes are
captured like the target's decode graphs (cuda_graphs.py). A replay reads four static buffers: each
row's first input token, the hidden state it starts from (eagle3), the position of its newest
token (`start`) and its block table with the scratch blocks past its own (DraftPlan.tables). Rows
past the step's (the padding of the captured size) have start -1: they store no K/V and attend to
nothing (slot -1, length 0), and their drafts are never read.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch

from worker_svc.cuda_graphs import capture_largest_first, graph_batch_sizes

# (first tokens [n], start hidden states [n, hidden] or None, start positions [n], tables [n, width])
#   -> drafts [n, k]; a padding row has start -1.
Passes = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftingGraphs:
    def __init__(self, passes: Passes, *, max_batch_size: int, width: int, hidden: tuple[int, torch.dtype] | None,
                 device: torch.device) -> None:
        self.passes = passes
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        largest = self.batch_sizes[-1]
        with torch.device(device):
            self.token = torch.zeros(largest, dtype=torch.int64)
            self.start = torch.full((largest,), -1, dtype=torch.int64)
            self.tables = torch.zeros(largest, width, dtype=torch.int64)
            self.hidden = torch.zeros(largest, hidden[0], dtype=hidden[1]) if hidden is not None else None
        self.drafts: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def fits(self, n: int) -> bool:
        return n <= self.batch_sizes[-1]

    def run(self, token: torch.Tensor, hidden: torch.Tensor | None, start: torch.Tensor,
            tables: torch.Tensor) -> torch.Tensor:
        """The drafts [n, k] of n rows (a view of a static buffer: read it before the next run)."""
        n = len(token)
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        self.token[:n].copy_(token)
        self.start[:n].copy_(start)
        self.start[n:padded].fill_(-1)
        if self.hidden is not None:
            self.hidden[:n].copy_(hidden)
        # Columns past the step's width keep stale ids: no row's length reaches them.
        self.tables[:n, :tables.shape[1]].copy_(tables)
        self.graphs[padded].replay()
        return self.drafts[:n]

    def _body(self, size: int) -> torch.Tensor:
        hidden = self.hidden[:size] if self.hidden is not None else None
        return self.passes(self.token[:size], hidden, self.start[:size], self.tables[:size])

    def _captured(self, size: int) -> None:
        """What a graph holds: the passes, their drafts written to the static buffer."""
        self.drafts[:size] = self._body(size)

    def _warm_up(self, size: int) -> None:
        warm = self._body(size)   # every start is -1: nothing is stored
        if self.drafts is None:
            self.drafts = torch.empty((self.batch_sizes[-1], warm.shape[1]), dtype=warm.dtype, device=warm.device)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.graphs = capture_largest_first(self.batch_sizes, self._warm_up, self._captured)
