"""The spec bench stage's replay proposer: at p = 1 it proposes the recorded greedy continuation
from where each row stands, at p = 0 none of its drafts is right, and a row it has no record of
gets no drafts; a method's predicted speedup."""
from __future__ import annotations

import numpy as np

from bench.stages.spec import ReplayProposer, predicted_speedup
from worker_svc.input_batch import InputBatch

PROMPT = 4


def _batch_with(rows: list[list[int]]) -> InputBatch:
    batch = InputBatch(64, 8, initial_rows=len(rows), max_drafts=4)
    for row, tokens in enumerate(rows):
        batch.token_ids[row, :len(tokens)] = tokens
        batch.num_tokens[row] = len(tokens)
    return batch


def _key(batch: InputBatch, tokens: list[int]) -> bytes:
    return np.asarray(tokens[:PROMPT], np.int64).astype(batch.token_ids.dtype).tobytes()


def test_a_certain_replay_proposes_the_recorded_continuation_from_each_rows_position():
    full = [5, 6, 7, 8, 40, 41, 42, 43, 44, 45]
    batch = _batch_with([full[:5], full[:8], [9, 9, 9, 9, 1]])
    proposer = ReplayProposer(batch, PROMPT, {_key(batch, full): np.asarray(full)}, 4, 1.0, 100)
    drafts = proposer.propose_on_host(np.arange(3))
    assert [d.tolist() for d in drafts] == [[41, 42, 43, 44], [44, 45], []]


def test_a_replay_that_is_never_right_proposes_only_wrong_tokens():
    full = [5, 6, 7, 8, 40, 41, 42, 99]
    batch = _batch_with([full[:4]])
    proposer = ReplayProposer(batch, PROMPT, {_key(batch, full): np.asarray(full)}, 4, 0.0, 100)
    (drafts,) = proposer.propose_on_host(np.arange(1))
    assert drafts.tolist() == [41, 42, 43, 0]


def test_the_predicted_speedup_is_the_tokens_per_step_over_the_methods_step():
    assert predicted_speedup(method_step_ms=20.0, base_step_ms=10.0, length=3.0) == 30.0 / 20.0
