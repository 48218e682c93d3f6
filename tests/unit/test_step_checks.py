"""Step checks (worker_svc/step_checks.py) without a model: a persistent batch holding one
request, and steps that each get one thing wrong. Each is refused with the error class the
server maps to its status (StaleMirrorError: FAILED_PRECONDITION, InvalidStepError:
INVALID_ARGUMENT) and a message naming the step, the request and the field; the batch is left
as it was. Well-formed steps pass, with their rows in batch order and their grammar matchers."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from worker_svc.input_batch import InputBatch
from worker_svc.layers.sampler import SamplingOptions
from worker_svc.runner_io import InvalidStepError, NewRequest, RequestFailure, StaleMirrorError, StepInput
from worker_svc.step_checks import StepLimits, check_step

LIMITS = StepLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, vocab_size=100, block_size=4,
                    num_kv_blocks=32, max_blocks_per_seq=16)
GREEDY = SamplingOptions(temperature=0.0)


def held_batch() -> InputBatch:
    """Request 1: a 12-token prompt computed into blocks 0..2 (full), then one sampled token,
    known only on the device."""
    batch = InputBatch(LIMITS.max_model_len, LIMITS.max_blocks_per_seq, initial_rows=LIMITS.max_num_seqs)
    row = batch.add(NewRequest(1, list(range(1, 13)), 12, 0, 12, [0, 1, 2], GREEDY), None)
    batch.num_computed[row] = 12
    batch.num_tokens[row] = 13
    return batch


def new(seq_id: int = 2, token_ids=(5, 6, 7), *, num_prompt: int | None = None, computed: int = 0,
        scheduled: int | None = None, blocks=(3,), sampling=GREEDY, constraint=None) -> NewRequest:
    token_ids = list(token_ids)
    if constraint is not None:
        sampling = dataclasses.replace(sampling, constraint=constraint)
    return NewRequest(seq_id, token_ids, len(token_ids) if num_prompt is None else num_prompt, computed,
                      len(token_ids) - computed if scheduled is None else scheduled, list(blocks), sampling)


def step(new_requests=(), cached=(), finished=(), new_blocks=None) -> StepInput:
    """cached: (seq_id, num_scheduled) pairs; new_blocks: {index among cached: [block ids]}."""
    new_blocks = new_blocks or {}
    indices = sorted(new_blocks)
    return StepInput(7, list(finished), list(new_requests), [s for s, _ in cached],
                     np.array([n for _, n in cached], np.int64), np.array(indices, np.int64),
                     np.array([len(new_blocks[i]) for i in indices], np.int64),
                     np.array([b for i in indices for b in new_blocks[i]], np.int64))


def snapshot(batch: InputBatch) -> tuple:
    return (dict(batch.row_of), batch.num_tokens.tolist(), batch.num_computed.tolist(), batch.num_blocks.tolist(),
            batch.block_tables.tolist(), batch.version)


REFUSED = {
    "more requests than max_num_seqs": (
        step([new(s, blocks=(3 + s,)) for s in range(2, 7)]), InvalidStepError,
        "step 7: 5 requests exceed max_num_seqs 4"),
    "a cached request not held": (
        step(cached=[(9, 1)]), StaleMirrorError, "step 7, cached request 9: not running on this worker"),
    "a cached request also finished": (
        step(cached=[(1, 1)], finished=[1]), StaleMirrorError, "cached request 1: listed as finished in the same step"),
    "a cached request twice": (
        step(cached=[(1, 1), (1, 1)]), InvalidStepError, "a cached request is listed twice"),
    "a new request twice": (
        step([new(), new(blocks=(4,))]), InvalidStepError, "new request 2: listed twice in one step"),
    "a new request already held": (
        step([new(1)]), StaleMirrorError, "new request 1: already running here"),
    "no prompt tokens": (
        step([new(num_prompt=0)]), InvalidStepError, r"num_prompt_tokens 0 not in 1..3 \(token_ids\)"),
    "more tokens than max_model_len": (
        step([new(token_ids=[5] * 65, scheduled=1)]), InvalidStepError, "65 tokens exceed max_model_len 64"),
    "a token id past the vocabulary": (
        step([new(token_ids=[5, 100])]), InvalidStepError, "token id 100 >= vocab_size 100"),
    "a logit_bias token id past the vocabulary": (
        step([new(sampling=SamplingOptions(logit_bias=((3, 1.0), (100, 2.0))))]), InvalidStepError,
        "logit_bias token id 100 >= vocab_size 100"),
    "nothing scheduled": (
        step([new(scheduled=0)]), InvalidStepError, "new request 2: num_scheduled_tokens is 0"),
    "a new request scheduled past its tokens": (
        step([new(computed=2, scheduled=2)]), InvalidStepError,
        r"past the known tokens \(2 computed \+ 2 scheduled > 3"),
    "a new request's block past the cache": (
        step([new(blocks=(32,))]), InvalidStepError, r"block id 32 out of range \(the cache has 32\)"),
    "a new request with more blocks than max_model_len needs": (
        step([new(blocks=range(3, 20))]), InvalidStepError, "17 blocks exceed 16"),
    "a new request's blocks too few": (
        step([new(token_ids=range(5, 10))]), InvalidStepError, "1 blocks of 4 cannot hold 5 tokens"),
    "more tokens than the step budget": (
        step([new(token_ids=[5] * 64, blocks=range(16, 32))], cached=[(1, 1)], new_blocks={0: [3]}),
        InvalidStepError, "step 7: 65 tokens exceed max_num_batched_tokens 64"),
    "a cached request scheduled past its tokens": (
        step(cached=[(1, 2)], new_blocks={0: [3]}), InvalidStepError,
        r"cached request 1: scheduling past the known tokens \(12 computed \+ 2 scheduled > 13 known\)"),
    "a cached request's new block past the cache": (
        step(cached=[(1, 1)], new_blocks={0: [40]}), InvalidStepError, "block id 40 out of range"),
    "a cached request grown past max_model_len's blocks": (
        step(cached=[(1, 1)], new_blocks={0: list(range(3, 17))}), InvalidStepError,
        "cached request 1: 17 blocks exceed 16"),
    "a cached request's blocks too few": (
        step(cached=[(1, 1)]), InvalidStepError, "cached request 1: 3 blocks of 4 cannot hold 13 tokens"),
    "a cached request past its tokens with a block past the cache: the first check's message": (
        step(cached=[(1, 2)], new_blocks={0: [40]}), InvalidStepError, "cached request 1: scheduling past the known"),
    "a cached request's block past the cache and too many blocks: the first check's message": (
        step(cached=[(1, 1)], new_blocks={0: [40] + list(range(3, 16))}), InvalidStepError, "block id 40 out of range"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_malformed_step_is_refused_naming_what_is_wrong_and_changes_nothing(case):
    bad, error, message = REFUSED[case]
    batch = held_batch()
    before = snapshot(batch)
    with pytest.raises(error, match=message) as refused:
        check_step(bad, LIMITS, batch, None)
    assert refused.type is error   # a stale mirror is not just any invalid step, and vice versa
    assert snapshot(batch) == before


def test_a_step_may_compute_the_newest_sampled_token_but_no_older_one():
    batch = held_batch()
    row = batch.row_of[1]
    rows, _, _ = check_step(step(cached=[(1, 1)], new_blocks={0: [3]}), LIMITS, batch, None)
    assert rows.tolist() == [row]
    batch.num_tokens[row] = 14        # two sampled tokens the host has not seen
    with pytest.raises(InvalidStepError, match=r"positions 12..12 include sampled tokens older than the newest"):
        check_step(step(cached=[(1, 1)], new_blocks={0: [3]}), LIMITS, batch, None)


class FakeStructured:
    """Makes a matcher per constraint; a constraint "bad" fails as a grammar would."""

    def matcher_or_failure(self, seq_id, constraint, output_token_ids):
        if constraint == "bad":
            return RequestFailure(seq_id, "INVALID_ARGUMENT", "is invalid: properties must be an object", True)
        return (constraint, tuple(output_token_ids))


def test_a_well_formed_step_passes_with_its_rows_and_its_grammar_matchers():
    batch = held_batch()
    ok = step([new(2, [5, 6, 7, 8], num_prompt=3, blocks=(4,), constraint="regex"), new(3, blocks=(5,))],
              cached=[(1, 1)], new_blocks={0: [3]})
    rows, matchers, failed = check_step(ok, LIMITS, batch, FakeStructured())
    assert rows.tolist() == [batch.row_of[1]]
    assert matchers == {2: ("regex", (8,))}            # made over the output so far
    assert failed == []
    assert check_step(ok, LIMITS, batch, None)[1] == {}   # ranks that do not sample make none
    # A request finished in this step may come back in it as new (a re-send after preemption).
    assert check_step(step([new(1, blocks=(6,))], finished=[1]), LIMITS, batch, None)[0].tolist() == []


def test_a_bad_constraint_fails_its_request_alone_and_the_step_goes_on():
    batch = held_batch()
    rows, matchers, failed = check_step(step([new(constraint="bad"), new(3, blocks=(5,), constraint="regex")]),
                                        LIMITS, batch, FakeStructured())
    assert failed == [RequestFailure(2, "INVALID_ARGUMENT", "is invalid: properties must be an object", True)]
    assert list(matchers) == [3]
