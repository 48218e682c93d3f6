"""What the proposers that run a model on the device (eagle3, draft) share: their own KV cache on
the target's block tables, each step's drafting plan, and the drafting passes' attention metadata.

The drafter's cache has as many blocks as the target's, at the same ids, so a step's slot mapping
and block tables serve both: the drafter computes every position the target computes (prefill
chunks, decodes, verified runs), and positions of rejected drafts are written again when their
real tokens are computed. Its drafting passes run past the newest token, where the target may
hold no block yet: there each sampling row of the step borrows scratch blocks of its own, after
the shared ones (`plan`), and what it writes there is never read by a later step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from worker_svc import kv_cache
from worker_svc.input_batch import InputBatch
from worker_svc.layers.attention import AttentionMetadata
from worker_svc.spec_decode.verification import decode_rows

if TYPE_CHECKING:
    from worker_svc.cuda_graphs import DecodeGraphs
    from worker_svc.model_runner import ModelRunner
    from worker_svc.step_batch import StepBatch


@dataclass
class DraftPlan:
    """A step's drafting facts, on the device."""
    last_index: torch.Tensor       # int64 [requests]: each request's last token in the step
    next_host_ids: torch.Tensor    # int64 [requests]: the known token after it (0: not known on the host)
    tables: torch.Tensor           # int64 [sampling rows, width]: block tables, scratch past each row's blocks
    base_positions: torch.Tensor   # int64 [sampling rows]: the newest token's position when no draft is accepted
    max_seq_len: int               # bound of the drafting passes' context lengths


@dataclass
class HostPlan:
    """A step's drafting plan on the host: DraftPlan's four tensors as staging parts."""
    parts: list[np.ndarray]
    width: int
    max_seq_len: int

    def on_device(self, views: list[torch.Tensor]) -> DraftPlan:
        """The plan over the device views of its parts."""
        last, host_ids, flat, base = views
        return DraftPlan(last, host_ids, flat.view(len(base), self.width), base, self.max_seq_len)


class ModelProposer:
    """A proposer running `module` (attention_layers() like a model's, `num_kv_heads` of them in
    all) on the device."""
    on_device = True
    aux_layers: tuple[int, ...] = ()   # target layers whose entering hidden states it reads
    start_hidden: tuple[int, torch.dtype] | None = None   # the drafting passes' start hidden state (width, dtype)

    def __init__(self, runner: ModelRunner, module: nn.Module, num_kv_heads: int, head_dim: int,
                 num_drafts: int) -> None:
        # Split across tensor-parallel ranks as the target's heads are.
        self.module, self.num_kv_heads = module, num_kv_heads // runner.tp_size
        self.head_dim, self.num_drafts = head_dim, num_drafts
        self.device, self.dtype, self.block_size = runner.device, runner.dtype, runner.block_size
        self.max_model_len, self.max_rows = runner.max_model_len, runner.config.max_num_seqs
        self.host_lengths = not runner.backend.supports_cuda_graphs   # its attention reads the host lists
        self.scratch_per_row = num_drafts // runner.block_size + 2
        self.num_shared_blocks = 0
        self._arange = torch.arange(self.max_rows + 1, device=runner.device)
        # CUDA graphs (capture_graphs, on a GPU): None runs eagerly.
        self.catch_up_graphs: DecodeGraphs | None = None
        self.drafting_graphs = self._target_graphs = None

    def propose_on_host(self, rows: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError(f"{self.method} proposes on the device")

    # --- its KV cache --------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes of one block of its cache (beside each of the target's)."""
        return kv_cache.block_bytes(len(self.module.attention_layers()), self.block_size, self.num_kv_heads,
                                    self.head_dim, self.dtype)

    def scratch_bytes(self) -> int:
        return self.max_rows * self.scratch_per_row * self.block_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """num_blocks shared with the target (the same ids), then every row's scratch blocks."""
        self.num_shared_blocks = num_blocks
        kv_cache.allocate_kv_cache(self.module, num_blocks + self.max_rows * self.scratch_per_row, self.block_size,
                                   self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def release_kv_cache(self) -> None:
        kv_cache.unbind_kv_cache(self.module)

    # --- a step ----------------------------------------------------------------------------------

    def plan(self, b: InputBatch, rows: np.ndarray, seq_lens: np.ndarray, query_start: np.ndarray,
             samples: np.ndarray, num_drafts: np.ndarray | None) -> HostPlan:
        """The step's drafting plan on the host, from the batch before the step's counts advance:
        `seq_lens` per row after the step, `num_drafts` per sampling row (None: none verified). Its
        parts travel in the step's one host-to-device copy (batch_prep.py)."""
        bs, k = self.block_size, self.num_drafts
        after = np.minimum(seq_lens, self.max_model_len - 1)
        next_host = np.where(seq_lens < b.num_host_tokens[rows], b.token_ids[rows, after], 0)
        sampling_rows = rows[samples]
        base = seq_lens[samples] - (num_drafts if num_drafts is not None else 0)
        top = np.minimum(seq_lens[samples] + k, self.max_model_len)
        max_seq_len = int(top.max()) if len(top) else 0
        width = -(-max_seq_len // bs)
        column = np.arange(width)
        owned = b.num_blocks[sampling_rows][:, None]
        scratch = (self.num_shared_blocks + np.arange(len(sampling_rows))[:, None] * self.scratch_per_row
                   + np.clip(column - owned, 0, self.scratch_per_row - 1))
        tables = np.where(column < owned, b.block_tables[sampling_rows, :width], scratch)
        return HostPlan([query_start[1:] - 1, next_host, tables.reshape(-1), base], width, max_seq_len)

    # --- CUDA graphs ----------------------------------------------------------------------------

    def capture_graphs(self, runner: ModelRunner, target: DecodeGraphs) -> None:
        """Graphs of the catch-up (over the target's decode graphs' inputs) and of the drafting
        passes, for steps of up to --speculative-graph-batch-size requests; larger ones run eagerly."""
        from worker_svc.cuda_graphs import DecodeGraphs
        from worker_svc.spec_decode.drafting_graphs import DraftingGraphs

        requests = runner.config.speculative_graph_batch_size
        self.catch_up_graphs = DecodeGraphs(self.catch_up_forward(target), max_batch_size=decode_rows(requests, self.num_drafts),
                                            max_blocks_per_seq=runner.max_blocks_per_seq,
                                            max_model_len=self.max_model_len, device=self.device, inputs_of=target)
        self.drafting_graphs = DraftingGraphs(
            functools.partial(self.draft_passes, max_seq_len=self.max_model_len),
            max_batch_size=min(requests, self.max_rows), width=runner.max_blocks_per_seq,
            hidden=self.start_hidden, device=self.device)
        self._target_graphs = target

    def catch_up_forward(self, target: DecodeGraphs):
        """The catch-up as a decode graph's forward (input_ids, positions, meta) -> outputs."""
        raise NotImplementedError

    def replays_catch_up(self, runner: ModelRunner, batch: StepBatch) -> bool:
        """Whether this step's target forward ran the decode graphs, and its catch-up has one too."""
        graphs = self.catch_up_graphs
        return (graphs is not None and runner.decode_graphs is self._target_graphs and graphs.usable
                and (batch.graph or runner.decode_graphs.can_run(batch.meta))
                and len(batch.input_ids) <= graphs.batch_sizes[-1])

    # --- a step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, runner: ModelRunner, batch: StepBatch, aux: list[torch.Tensor] | None,
            tokens: torch.Tensor | None, propose: bool) -> tuple[torch.Tensor, np.ndarray] | None:
        """Catches up on the step's tokens; when asked (and the step sampled), drafts after each
        sampling row's newest token: (drafts [rows, k] on the device, counts)."""
        state = self.catch_up(runner, batch, aux, tokens)
        if not propose or tokens is None:
            return None
        plan = batch.draft_plan
        start = plan.base_positions + (batch.accepted if batch.accepted is not None else 0)
        token, hidden = self.first_inputs(runner, batch, state)
        if self.drafting_graphs is not None and self.drafting_graphs.fits(len(token)):
            drafts = self.drafting_graphs.run(token, hidden, start, plan.tables)
        else:
            drafts = self.draft_passes(token, hidden, start, plan.tables, max_seq_len=plan.max_seq_len)
        return drafts, np.full(len(batch.sampling_rows), self.num_drafts, dtype=np.int64)

    def catch_up(self, runner: ModelRunner, batch: StepBatch, aux, tokens):
        """Computes the step's positions in its own cache; returns what drafting starts from."""
        raise NotImplementedError

    def first_inputs(self, runner: ModelRunner, batch: StepBatch, state) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each sampling row's first drafting input: (token, hidden state or None)."""
        raise NotImplementedError

    def draft_passes(self, token: torch.Tensor, hidden: torch.Tensor | None, start: torch.Tensor,
                     tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """[rows, k] drafts after each row's newest token at `start` (-1: a padding row of a graph),
        `tables` its block tables (int64); max_seq_len bounds the passes' context lengths."""
        raise NotImplementedError

    def pass_meta(self, tables: torch.Tensor, start: torch.Tensor, j: int,
                  max_seq_len: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """The j-th drafting pass's positions and attention metadata: one token per row at its
        newest token's position + j (past max_model_len: the last, whose drafts are cut); a row
        with start -1 stores nothing and attends to nothing."""
        n, bs = len(start), self.block_size
        positions = (start + j).clamp(0, self.max_model_len - 1)
        live = start >= 0
        slots = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs + positions % bs
        seq_lens = torch.where(live, positions + 1, 0).to(torch.int32)
        host = seq_lens.tolist() if self.host_lengths else [max_seq_len] * n
        return positions, AttentionMetadata(
            slot_mapping=torch.where(live, slots, -1), query_start_loc=self._arange[:n + 1].to(torch.int32),
            seq_lens=seq_lens, block_tables=tables.to(torch.int32), max_query_len=1, max_seq_len=max_seq_len,
            query_lens_cpu=[1] * n, seq_lens_cpu=host)
