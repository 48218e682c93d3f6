"""The host side of a step that speculates, once its tokens are back: the persistent batch learns
how many drafts each request accepted (its counts move back over the rejected ones), every token
the step emitted is written into the rows (so proposers on the host see each request's whole
history), the drafts proposed for the next step are kept, and the reply lists only emitted tokens.

Steps are settled in the order they were launched, each once: by its own result(), or earlier by
the launch of a step that needs it settled (one that verifies drafts, or follows a step that did),
unless that step was launched ahead of the acceptance (spec_decode/ahead.py): its counts then move
right after the step before it is settled (`advance`), as its preparation would have moved them.
A row that changed hands meanwhile (its generation moved on) is left alone.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import Callable

import numpy as np
import torch

from worker_svc.input_batch import InputBatch
from worker_svc.runner_io import StepOutput, TopLogprobs
from worker_svc.spec_decode.verification import VerifyLayout

# (rows, generations) of requests to propose for on the host -> drafts per row (lists of tokens).
HostProposer = Callable[[np.ndarray], list[np.ndarray]]


@dataclasses.dataclass(eq=False)
class SpecStep:
    """What a launched step's bookkeeping needs, recorded at launch."""
    rows: np.ndarray                       # sampling rows, batch order
    generations: np.ndarray                # their generations at launch
    token_index: np.ndarray                # index of each row's first new token
    layout: VerifyLayout | None            # None: no drafts verified (one token each)
    propose: bool                          # the scheduler asked for drafts for the next step
    proposable: np.ndarray                 # bool per row: may get drafts (its request allows it)
    tokens: torch.Tensor | None = None     # host, one per sampled position (behind `event`)
    accepted: torch.Tensor | None = None   # host, per row (when drafts were verified)
    drafts: torch.Tensor | None = None     # host [rows, k]: drafts a device proposer made
    draft_counts: np.ndarray | None = None
    # The same on the device, for a step launched before this one is settled (spec_decode/ahead.py).
    device_accepted: torch.Tensor | None = None
    device_drafts: torch.Tensor | None = None
    # Launched ahead of the step before's acceptance: tokens each row computes, added to its count
    # once that step is settled (token_index is set then).
    advance: np.ndarray | None = None
    event: object = None
    settled: bool = False
    emitted: np.ndarray | None = None      # bool per sampled position
    token_counts: list[int] | None = None
    verified_drafts: list[int] | None = None
    num_drafts: list[int] | None = None


class Bookkeeping:
    def __init__(self, batch: InputBatch, max_model_len: int, lock: threading.Lock,
                 propose_on_host: HostProposer | None) -> None:
        self.batch = batch
        self.max_model_len = max_model_len
        self.lock = lock                   # also held by the runner while it changes the batch
        self.propose_on_host = propose_on_host
        self._pending: deque[SpecStep] = deque()

    def track(self, step: SpecStep) -> None:
        """Queues a launched step (call with the lock held)."""
        self._pending.append(step)

    @property
    def must_settle(self) -> bool:
        """A step in flight verified drafts: the next one's rows are not known until it is settled."""
        return any(step.layout is not None for step in self._pending)

    def only_in_flight(self) -> SpecStep | None:
        """The one step in flight, if exactly one is and its own counts have moved (call with the
        lock held): a step may be launched ahead of its acceptance."""
        if len(self._pending) != 1 or self._pending[0].advance is not None:
            return None
        return self._pending[0]

    def settle_all(self) -> None:
        """Settles every step launched so far, waiting for their tokens (call with the lock held)."""
        while self._pending:
            self._settle(self._pending.popleft())

    def finish(self, step: SpecStep, output: StepOutput) -> StepOutput:
        """The step's reply: settled (and the steps before it), with only its emitted tokens."""
        with self.lock:
            while not step.settled and self._pending:
                self._settle(self._pending.popleft())
            if not step.settled:                # dropped by a reset: its rows are gone anyway
                self._settle(step)
        counts = dict(token_counts=step.token_counts, num_drafts=step.num_drafts, verified_drafts=step.verified_drafts)
        if step.emitted is None or step.emitted.all():
            return dataclasses.replace(output, **counts)
        keep = step.emitted
        tokens = [t for t, k in zip(output.token_ids, keep) if k]
        logprobs = [v for v, k in zip(output.logprobs, keep) if k] if output.logprobs is not None else None
        return dataclasses.replace(output, token_ids=tokens, logprobs=logprobs,
                                   top_logprobs=_kept_top(output.top_logprobs, keep), **counts)

    def _settle(self, step: SpecStep) -> None:
        if step.advance is not None:   # the step before it never settled (dropped by a reset)
            self._advance(step)
        if step.event is not None:
            step.event.synchronize()
        b = self.batch
        live = b.generation[step.rows] == step.generations
        num_rows = len(step.rows)
        accepted = step.accepted.numpy() if step.accepted is not None else np.zeros(num_rows, np.int64)
        tokens = step.tokens.numpy()
        if step.layout is not None:
            layout = step.layout
            step.emitted = layout.offset <= accepted[layout.owner]
            owner, offset = layout.owner[step.emitted], layout.offset[step.emitted]
            values = tokens[:layout.num_positions][step.emitted]
            self._cut_rejected(step.rows[live], layout.num_drafts[live], accepted[live])
            if layout.max_drafts:
                step.token_counts = (accepted + 1).tolist()
                step.verified_drafts = layout.num_drafts.tolist()
        else:
            owner, offset, values = np.arange(num_rows), np.zeros(num_rows, np.int64), tokens[:num_rows]
        self._write_tokens(step, live, owner, offset, values, accepted)
        self._keep_drafts(step, live)
        step.settled = True
        step.device_accepted = step.device_drafts = None
        if self._pending and self._pending[0].advance is not None:
            self._advance(self._pending[0])

    def _advance(self, step: SpecStep) -> None:
        """A step launched ahead of the acceptance of the one just settled: its rows' counts move
        now, as its preparation would have moved them had it been prepared after that settle."""
        b = self.batch
        live = b.generation[step.rows] == step.generations
        step.token_index = b.num_tokens[step.rows].copy()
        rows = step.rows[live]
        b.num_computed[rows] += step.advance[live]
        b.num_tokens[rows] += 1
        step.advance = None

    def _write_tokens(self, step: SpecStep, live: np.ndarray, owner: np.ndarray, offset: np.ndarray,
                      values: np.ndarray, accepted: np.ndarray) -> None:
        b = self.batch
        index = step.token_index[owner] + offset
        ok = live[owner] & (index < self.max_model_len)
        b.token_ids[step.rows[owner[ok]], index[ok]] = values[ok]
        rows = step.rows[live]
        ends = step.token_index[live] + accepted[live] + 1
        b.num_host_tokens[rows] = np.minimum(np.maximum(b.num_host_tokens[rows], ends), b.num_tokens[rows])

    def _cut_rejected(self, rows: np.ndarray, num_drafts: np.ndarray, accepted: np.ndarray) -> None:
        """Rows that verified drafts: their rejected drafts' positions are not computed (their KV
        slots stay in the block table, for the tokens that follow to overwrite)."""
        b = self.batch
        drafted = num_drafts > 0
        rows, rejected, accepted = rows[drafted], (num_drafts - accepted)[drafted], accepted[drafted]
        b.num_computed[rows] -= rejected
        b.num_tokens[rows] += accepted

    def _keep_drafts(self, step: SpecStep, live: np.ndarray) -> None:
        """The drafts each row holds for its next step: those proposed now, else none."""
        b = self.batch
        b.num_drafts[step.rows[live]] = 0
        if not step.propose:
            return
        counts = np.zeros(len(step.rows), np.int64)
        # A row whose history the host does not hold in full (a later step is in flight) gets none.
        whole = live & step.proposable & (b.num_host_tokens[step.rows] == b.num_tokens[step.rows])
        room = np.maximum(self.max_model_len - b.num_tokens[step.rows], 0)
        if step.drafts is not None:
            counts = np.where(whole, np.minimum(step.draft_counts, room), 0)
            drafts = step.drafts.numpy()
            width = drafts.shape[1]
            b.draft_tokens[step.rows[whole], :width] = drafts[whole]
        elif self.propose_on_host is not None and whole.any():
            for i, proposal in zip(np.flatnonzero(whole), self.propose_on_host(step.rows[whole])):
                n = min(len(proposal), int(room[i]))
                b.draft_tokens[step.rows[i], :n] = proposal[:n]
                counts[i] = n
        b.num_drafts[step.rows] = np.where(live, counts, b.num_drafts[step.rows])
        step.num_drafts = counts.tolist()


def _kept_top(top: TopLogprobs | None, keep: np.ndarray) -> TopLogprobs | None:
    """Top logprobs columns of the kept positions only."""
    if top is None:
        return None
    counts, ids, values, offset = [], [], [], 0
    for count, kept in zip(top.counts, keep.tolist()):
        if kept:
            counts.append(count)
            ids += top.token_ids[offset:offset + count]
            values += top.logprobs[offset:offset + count]
        offset += count
    return TopLogprobs(counts, ids, values)
