"""The eagle3 proposer: an EAGLE-3 head (models/eagle3.py) beside the target, on the device.

Every step it catches up: at each position the target computed it reads the target's hidden
states entering the aux layers and the token after the position (the next prompt token, or the
token the step sampled there), writing its one layer's KV. Asked for drafts, it takes its output
at each row's last emitted token's predecessor (its first draft) and drafts on k - 1 passes, one
token per row each, feeding its own pre-norm output back as the hidden state.
"""
from __future__ import annotations

import logging
import pathlib
from typing import TYPE_CHECKING

import torch

from worker_svc.loader import init_dummy_weights
from worker_svc.models.eagle3 import Eagle3Head, eagle3_checkpoint, load_eagle3_config, load_eagle3_weights
from worker_svc.spec_decode.drafter import ModelProposer

if TYPE_CHECKING:
    from worker_svc.cuda_graphs import DecodeGraphs
    from worker_svc.model_runner import ModelRunner
    from worker_svc.step_batch import StepBatch

logger = logging.getLogger(__name__)


def load_eagle3_head(runner: ModelRunner, head_dir: pathlib.Path) -> Eagle3Head:
    """The head on the runner's device and dtype, its embeddings the checkpoint's or the target's
    (with --load-format dummy: random weights, the identity d2t, the target's embeddings)."""
    from worker_svc.startup import default_dtype

    config = load_eagle3_config(head_dir, runner.model_config)
    dummy = runner.config.load_format == "dummy"   # random weights for the config (benchmarks)
    tensors = {} if dummy else eagle3_checkpoint(head_dir)
    own_embeddings = "embed_tokens.weight" in tensors
    if not own_embeddings and config.hidden_size != runner.model_config.hidden_size:
        raise ValueError(f"{head_dir}: a head without embed_tokens shares the target's, which are "
                         f"{runner.model_config.hidden_size} wide, not {config.hidden_size}")
    with torch.device(runner.device), default_dtype(runner.dtype):
        head = Eagle3Head(config, runner.backend, runner.max_model_len, own_embeddings).eval()
    if dummy:
        init_dummy_weights(head, runner.config.seed + 1)
    else:
        load_eagle3_weights(head, tensors, str(head_dir))
    if not own_embeddings:
        head.share_embeddings(runner.model.model.embed_tokens)
    logger.info("EAGLE-3 head %s: draft vocabulary %d, aux layers %s", head_dir, config.draft_vocab_size,
                list(config.aux_layers))
    return head


class Eagle3Proposer(ModelProposer):
    method = "eagle3"

    def __init__(self, runner: ModelRunner, head_dir: pathlib.Path, num_drafts: int) -> None:
        self.head = load_eagle3_head(runner, head_dir)
        config = self.head.config
        super().__init__(runner, self.head, config.num_key_value_heads, config.head_dim, num_drafts)
        self.aux_layers = config.aux_layers
        self.start_hidden = (config.hidden_size, runner.dtype)

    def catch_up(self, runner: ModelRunner, batch: StepBatch, aux: list[torch.Tensor], tokens: torch.Tensor | None):
        plan = batch.draft_plan
        ids = torch.roll(batch.input_ids, -1)   # the token after each position
        ids.index_copy_(0, plan.last_index, plan.next_host_ids)
        if tokens is not None:
            ids.index_copy_(0, batch.logits_indices, tokens)
        if self.replays_catch_up(runner, batch):   # over the inputs and aux states the target's graph wrote
            n = len(ids)
            self._ids[:n].copy_(ids)
            normed, (prenorm,) = self.catch_up_graphs.replay(n), self.catch_up_graphs.aux(n)
        else:
            normed, prenorm = self.head(ids, batch.positions, self.head.combine(aux), batch.meta)
        if tokens is None:
            return None
        first = (batch.verify.first if batch.verify is not None
                 else torch.arange(len(batch.sampling_rows), device=tokens.device))
        if batch.accepted is not None:
            first = first + batch.accepted
        at = batch.logits_indices.index_select(0, first)
        return self.head.greedy_tokens(normed[at]), prenorm[at]

    def catch_up_forward(self, target: DecodeGraphs):
        """The head over the target graph's inputs and aux outputs, the tokens after each position
        staged in `_ids`."""
        self._ids = torch.zeros_like(target.input_ids)

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta):
            n = len(positions)
            normed, prenorm = self.head(self._ids[:n], positions, self.head.combine([a[:n] for a in target.aux_outputs]),
                                        meta)
            return normed, [prenorm]
        return forward

    def first_inputs(self, runner: ModelRunner, batch: StepBatch, state) -> tuple[torch.Tensor, torch.Tensor]:
        return state

    def draft_passes(self, token: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor, tables: torch.Tensor,
                     max_seq_len: int) -> torch.Tensor:
        drafts = [token]
        for j in range(self.num_drafts - 1):
            positions, meta = self.pass_meta(tables, start, j, max_seq_len)
            normed, hidden = self.head(token, positions, hidden, meta)
            token = self.head.greedy_tokens(normed)
            drafts.append(token)
        return torch.stack(drafts, dim=1)
