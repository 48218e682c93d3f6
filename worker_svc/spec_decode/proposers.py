"""The worker's proposers of draft tokens (--speculative-method), behind one small interface.

A proposer on the host (ngram) proposes when a step is settled, from the tokens the persistent
batch holds; one on the device (eagle3, draft) proposes inside the step, right after the target's
tokens are sampled, and its drafts reach the host with them. Either way the drafts a row holds
are for its next step only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from worker_svc.config import WorkerConfig
from worker_svc.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    from worker_svc.model_runner import ModelRunner
    from worker_svc.step_batch import StepBatch
    from worker_svc.spec_decode.bookkeeping import SpecStep


class Proposer(Protocol):
    method: str
    on_device: bool

    def propose_on_host(self, rows: np.ndarray) -> list[np.ndarray]:
        """Drafts for each row (host proposers)."""

    def propose(self, runner: ModelRunner, batch: StepBatch, hidden: torch.Tensor,
                spec: SpecStep) -> tuple[torch.Tensor, np.ndarray]:
        """(drafts [sampling rows, k] on their way to the host, how many each row has) for the
        step's sampling rows (device proposers)."""


class NgramProposer:
    method = "ngram"
    on_device = False

    def __init__(self, runner: ModelRunner, num_drafts: int) -> None:
        self.batch = runner.batch
        self.num_drafts = num_drafts

    def propose_on_host(self, rows: np.ndarray) -> list[np.ndarray]:
        b = self.batch
        return [propose_ngram(b.token_ids[row, :b.num_tokens[row]], self.num_drafts) for row in rows.tolist()]

    def propose(self, runner, batch, hidden, spec):
        raise NotImplementedError("ngram proposes on the host")


def build_proposer(runner: ModelRunner, config: WorkerConfig) -> Proposer:
    if config.speculative_method == "ngram":
        return NgramProposer(runner, config.num_speculative_tokens)
    raise ValueError(f"--speculative-method {config.speculative_method}: this worker proposes with ngram only "
                     "so far (docs/SPECULATIVE.md)")
