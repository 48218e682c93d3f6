"""The draft proposer: a smaller Qwen3 with the target's tokenizer (e.g. Qwen3-0.6B for Qwen3-8B),
loaded like the target, beside it on the device.

Every step it computes the target's inputs in its own cache (the same slots). Asked for drafts,
it decodes k tokens greedily after each sampling row's newest token, one pass per draft. With
tensor parallelism it is split as the target is, and every rank learns each draft (ParallelLMHead.greedy).
"""
from __future__ import annotations

import logging
import pathlib
from typing import TYPE_CHECKING

import torch

from worker_svc.model_config import load_model_config
from worker_svc.models import build_model
from worker_svc.models.qwen3 import head_dim_of
from worker_svc.loader import init_dummy_weights, load_safetensors
from worker_svc.spec_decode.drafter import ModelProposer

if TYPE_CHECKING:
    from worker_svc.cuda_graphs import DecodeGraphs
    from worker_svc.model_runner import ModelRunner
    from worker_svc.step_batch import StepBatch

logger = logging.getLogger(__name__)


def load_draft_model(runner: ModelRunner, model_dir: pathlib.Path) -> torch.nn.Module:
    from worker_svc.startup import default_dtype

    config = load_model_config(model_dir)
    if config.vocab_size != runner.vocab_size:
        raise ValueError(f"{model_dir}: the draft model's vocab_size {config.vocab_size} differs from the target's "
                         f"{runner.vocab_size}; a draft model shares the target's tokenizer")
    with torch.device(runner.device), default_dtype(runner.dtype):
        model = build_model(config, runner.backend, runner.max_model_len, None, runner.device).eval()
    if runner.config.load_format == "dummy":   # random weights for the config (benchmarks)
        init_dummy_weights(model, runner.config.seed + 1, std=config.initializer_range)
    else:
        load_safetensors(model, model_dir)
    logger.info("draft model %s: %d layers, hidden %d", model_dir, config.num_hidden_layers, config.hidden_size)
    return model


class DraftModelProposer(ModelProposer):
    method = "draft"

    def __init__(self, runner: ModelRunner, model_dir: pathlib.Path, num_drafts: int) -> None:
        self.model = load_draft_model(runner, model_dir)
        config = self.model.config
        super().__init__(runner, self.model, config.num_key_value_heads, head_dim_of(config), num_drafts)

    def catch_up(self, runner: ModelRunner, batch: StepBatch, aux, tokens):
        if self.replays_catch_up(runner, batch):   # over the inputs the target's graph just read
            self.catch_up_graphs.replay(len(batch.input_ids))
        else:
            self.model(batch.input_ids, batch.positions, batch.meta)

    def catch_up_forward(self, target: DecodeGraphs):
        return self.model

    def first_inputs(self, runner: ModelRunner, batch: StepBatch, state) -> tuple[torch.Tensor, None]:
        return runner.last_sampled.index_select(0, batch.sampling_rows_device), None

    def draft_passes(self, token: torch.Tensor, hidden: None, start: torch.Tensor, tables: torch.Tensor,
                     max_seq_len: int) -> torch.Tensor:
        drafts = []
        for j in range(self.num_drafts):
            positions, meta = self.pass_meta(tables, start, j, max_seq_len)
            token = self.model.lm_head.greedy(self.model(token, positions, meta))   # on every rank
            drafts.append(token)
        return torch.stack(drafts, dim=1)
