"""The worker's proposers of draft tokens (--speculative-method), behind one small interface.

A proposer on the host (ngram) proposes when a step is settled, from the tokens the persistent
batch holds; one on the device (eagle3, draft) proposes inside the step, right after the target's
tokens are sampled, and its drafts reach the host with them. Either way the drafts a row holds
are for its next step only.
"""
from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from worker_svc.config import WorkerConfig
from worker_svc.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    from worker_svc.model_runner import ModelRunner
    from worker_svc.step_batch import StepBatch


class Proposer(Protocol):
    method: str
    on_device: bool
    aux_layers: tuple[int, ...]   # target layers whose entering hidden states `run` reads (eagle3)

    def propose_on_host(self, rows: np.ndarray) -> list[np.ndarray]:
        """Drafts for each row (host proposers)."""

    def run(self, runner: ModelRunner, batch: StepBatch, aux: list[torch.Tensor] | None,
            tokens: torch.Tensor | None, propose: bool) -> tuple[torch.Tensor, np.ndarray] | None:
        """Device proposers, every step after its sampling: catch up on the step's tokens and,
        when `propose`, return (drafts [sampling rows, k] on their way to the host, how many each
        row has); spec_decode/drafter.py."""


class NgramProposer:
    method = "ngram"
    on_device = False
    aux_layers = ()

    def __init__(self, runner: ModelRunner, num_drafts: int) -> None:
        self.batch = runner.batch
        self.num_drafts = num_drafts

    def propose_on_host(self, rows: np.ndarray) -> list[np.ndarray]:
        b = self.batch
        return [propose_ngram(b.token_ids[row, :b.num_tokens[row]], self.num_drafts) for row in rows.tolist()]

    def run(self, runner, batch, aux, tokens, propose):
        raise NotImplementedError("ngram proposes on the host")


def build_proposer(runner: ModelRunner, config: WorkerConfig) -> Proposer:
    k = config.num_speculative_tokens
    if config.speculative_method == "ngram":
        return NgramProposer(runner, k)
    if config.speculative_method == "eagle3":
        from worker_svc.spec_decode.eagle3 import Eagle3Proposer

        return Eagle3Proposer(runner, pathlib.Path(config.speculative_model), k)
    if config.speculative_method == "draft":
        from worker_svc.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(runner, pathlib.Path(config.speculative_model), k)
    raise ValueError(f"--speculative-method {config.speculative_method!r} is not one of ngram, eagle3, draft")
