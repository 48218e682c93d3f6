"""Scheduler: chunked prefill, preemption and re-admission, stop conditions, aborts, resets."""
from __future__ import annotations

import itertools
from typing import Callable

import pytest

from scheduler_svc.engine.block_manager import BlockManager
from common.sampling import SamplingParams
from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.scheduler_output import SchedulerOutput
from scheduler_svc.engine.sequence import FinishReason, Sequence, SequenceStatus

EOS = 0
_ids = itertools.count(1)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 64, max_model_len: int | None = None, threshold: int = 0,
                   max_held_requests: int = 0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len or num_blocks * block_size,
                             block_size=block_size,
                             long_prefill_token_threshold=threshold, max_held_requests=max_held_requests)
    return Scheduler(config, BlockManager(num_blocks, block_size), eos_token_ids=[EOS])


def add(sched: Scheduler, prompt: list[int], **params) -> Sequence:
    params.setdefault("max_tokens", 100)
    seq = Sequence(next(_ids), f"req-{len(prompt)}", prompt, SamplingParams(**params))
    sched.add(seq)
    return seq


def step(sched: Scheduler, token: int | Callable[[Sequence], int] = 7) -> tuple[SchedulerOutput, list[Sequence]]:
    """One engine step with a worker that samples `token` for every request it completes."""
    output = sched.schedule()
    return output, sched.update(output, sample(output, token))


def sample(output: SchedulerOutput, token: int | Callable[[Sequence], int] = 7) -> list[int]:
    """What a worker returns for the step: `token` for every request whose step samples."""
    return [token(seq) if callable(token) else token for seq in output.sampling_seqs]


def by_seq(output: SchedulerOutput, tokens: dict[int, int]) -> list[int]:
    """A reply built from {seq_id: token}, in the order the worker answers."""
    return [tokens[seq.seq_id] for seq in output.sampling_seqs]


def scheduled_tokens(output: SchedulerOutput) -> dict[int, int]:
    return {s.seq.seq_id: s.num_scheduled_tokens for s in output.scheduled}


def test_chunked_prefill_of_a_long_prompt_mixed_with_decodes():
    sched = make_scheduler(budget=16)
    a, b = add(sched, [1, 2, 3]), add(sched, [4, 5, 6])
    out, received = step(sched)
    assert scheduled_tokens(out) == {a.seq_id: 3, b.seq_id: 3} and received == [a, b]
    long = add(sched, list(range(10, 50)))               # 40 tokens, more than the budget
    out, received = step(sched)
    assert scheduled_tokens(out) == {a.seq_id: 1, b.seq_id: 1, long.seq_id: 14}
    assert [(r.seq_id, r.num_scheduled_tokens, r.new_block_ids) for r in out.cached_requests] == \
        [(a.seq_id, 1, []), (b.seq_id, 1, [])]
    (new,) = out.new_requests
    assert (new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens) == (long.seq_id, 0, 14)
    assert new.token_ids == long.token_ids and new.block_ids == long.block_table
    assert received == [a, b] and long.num_computed_tokens == 14 and long.num_output_tokens == 0
    assert long.is_prefill and not a.is_prefill
    out, received = step(sched)
    assert scheduled_tokens(out) == {a.seq_id: 1, b.seq_id: 1, long.seq_id: 14}
    (chunk,) = [r for r in out.cached_requests if r.seq_id == long.seq_id]
    assert chunk.new_block_ids == long.block_table[4:]   # slots 14..27 add blocks 4..6
    out, received = step(sched)
    assert scheduled_tokens(out) == {a.seq_id: 1, b.seq_id: 1, long.seq_id: 12}
    assert received == [a, b, long] and long.num_output_tokens == 1
    out, _ = step(sched)
    assert scheduled_tokens(out) == {a.seq_id: 1, b.seq_id: 1, long.seq_id: 1}
    assert out.num_scheduled_tokens == 3 and not out.new_requests


def test_long_prefill_token_threshold_caps_each_chunk():
    sched = make_scheduler(budget=64, threshold=5)
    seq = add(sched, list(range(1, 13)))
    chunks = [scheduled_tokens(step(sched)[0])[seq.seq_id] for _ in range(4)]
    assert chunks == [5, 5, 2, 1]                        # then it decodes one at a time


def test_preemption_when_blocks_run_out_and_readmission():
    sched = make_scheduler(num_blocks=6, block_size=4)
    a = add(sched, list(range(1, 9)), max_tokens=6)      # 8 tokens: two full blocks each
    b = add(sched, list(range(11, 19)))
    step(sched)                                          # both prefilled: 4 blocks used
    for _ in range(4):                                   # positions 8..11: one more block each
        out, _ = step(sched)
        assert not out.preempted_seq_ids
    assert sched.block_manager.num_free_blocks == 0
    b_tokens = list(b.token_ids)
    out, received = step(sched)                          # a needs a block for position 12
    assert out.preempted_seq_ids == [b.seq_id] and scheduled_tokens(out) == {a.seq_id: 1}
    assert sched.num_preemptions == 1
    assert b.status is SequenceStatus.PREEMPTED and b.block_table == [] and b.is_prefill
    assert list(sched.waiting) == [b]
    assert received == [a] and a.finish_reason is FinishReason.LENGTH
    out, received = step(sched)                          # b comes back
    (new,) = out.new_requests
    assert out.finished_seq_ids == [a.seq_id]
    assert new.seq_id == b.seq_id and new.token_ids == b_tokens == b.token_ids[:-1]
    assert new.num_prompt_tokens == 8
    # Its two prompt blocks were still cached; the block a took from it was not.
    assert new.num_computed_tokens == 8 and new.num_scheduled_tokens == 5
    assert b.num_cached_prompt_tokens == 0               # Usage counts the first admission
    assert received == [b] and b.num_output_tokens == 6 and not b.is_prefill
    out, _ = step(sched)
    assert [(r.seq_id, r.num_scheduled_tokens) for r in out.cached_requests] == [(b.seq_id, 1)]
    assert not out.new_requests


def test_preempted_request_waits_at_the_front_and_blocks_the_queue():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b = add(sched, [1, 2, 3, 4]), add(sched, [5, 6, 7, 8])
    c = add(sched, [9])                                  # waits for a free seat
    for _ in range(5):
        step(sched)                                      # positions 0..7: all 4 blocks used
    out, _ = step(sched)                                 # a needs a third block: b goes
    assert out.preempted_seq_ids == [b.seq_id] and scheduled_tokens(out) == {a.seq_id: 1}
    # A block and a seat are free now and c would fit, but b is first and does not.
    assert list(sched.waiting) == [b, c] and sched.block_manager.num_free_blocks == 1
    out, _ = step(sched)
    assert scheduled_tokens(out) == {a.seq_id: 1}


def test_after_a_reset_recomputed_blocks_are_cached_again():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    seq = add(sched, list(range(1, 11)))
    for _ in range(3):
        step(sched)                                      # 10 prompt + 2 decodes: 12 computed
    sched.reset_all_worker_state()                       # the worker's KV is gone
    out, _ = step(sched)
    (new,) = out.new_requests
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (0, 13)
    sched.finish(seq.seq_id)
    again = add(sched, list(seq.token_ids))
    out, _ = step(sched)
    (new,) = out.new_requests
    assert new.num_computed_tokens == 12 and again.num_cached_prompt_tokens == 12


def test_abort_frees_blocks_whatever_the_state():
    sched = make_scheduler(max_num_seqs=1)
    running = add(sched, list(range(1, 10)))
    waiting = add(sched, [1, 2, 3])
    step(sched)
    assert sched.block_manager.num_used_blocks == 3
    assert sched.abort(running.seq_id) is running
    assert sched.block_manager.num_used_blocks == 0
    assert running.status is SequenceStatus.FINISHED and running.finish_reason is FinishReason.ABORT
    assert sched.abort(running.seq_id) is None
    out, _ = step(sched)
    assert out.finished_seq_ids == [running.seq_id] and scheduled_tokens(out) == {waiting.seq_id: 3}
    sched.add(late := Sequence(next(_ids), "late", [4], SamplingParams()))
    assert sched.abort(late.seq_id) is late              # never sent: nothing for the worker
    assert sched.abort(waiting.seq_id) is waiting
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 64
    out = sched.schedule()
    assert out.is_empty and out.finished_seq_ids == []   # kept until a step is sent
    add(sched, [9])
    out = sched.schedule()
    assert out.finished_seq_ids == [waiting.seq_id]


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=10)
    seq = add(sched, list(range(1, 9)), max_tokens=100)
    _, r1 = step(sched)
    _, r2 = step(sched)
    assert r1 == r2 == [seq] and seq.num_tokens == 10
    assert seq.finish_reason is FinishReason.LENGTH and sched.block_manager.num_used_blocks == 0
    full = add(sched, list(range(1, 11)))                # a prompt of max_model_len: one token
    _, received = step(sched)
    assert received == [full] and full.finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError):
        add(sched, list(range(1, 12)))


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    seq = add(sched, [1, 2], max_tokens=3)
    for expected in (1, 2, 3):
        step(sched)
        assert seq.num_output_tokens == expected
    assert seq.finish_reason is FinishReason.LENGTH and not sched.has_unfinished()


def test_eos_min_tokens_and_stop_token_ids():
    sched = make_scheduler()
    plain = add(sched, [1])
    late_eos = add(sched, [2], min_tokens=2)
    ignoring = add(sched, [3], ignore_eos=True, stop_token_ids=(5,), max_tokens=2)
    _, received = step(sched, EOS)
    assert received == [plain, late_eos, ignoring]
    assert plain.finish_reason is FinishReason.STOP
    assert late_eos.status is ignoring.status is SequenceStatus.RUNNING
    _, received = step(sched, EOS)                       # EOS at the second token now counts
    assert late_eos.finish_reason is FinishReason.STOP
    assert ignoring.finish_reason is FinishReason.LENGTH  # ignore_eos: only max_tokens ends it
    assert ignoring.token_ids == [3, EOS, EOS]
    stopper = add(sched, [4], stop_token_ids=(5,), min_tokens=2)
    step(sched, 5)
    assert stopper.status is SequenceStatus.RUNNING      # stop token before min_tokens
    step(sched, 5)
    assert stopper.finish_reason is FinishReason.STOP
    capped = add(sched, [4], max_tokens=1)
    step(sched, EOS)
    assert capped.finish_reason is FinishReason.STOP     # the model stopped: not "length"


def test_finish_for_a_stop_string():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3])
    step(sched)
    assert sched.finish(seq.seq_id) is seq and seq.finish_reason is FinishReason.STOP
    assert sched.block_manager.num_used_blocks == 0 and sched.finish(seq.seq_id) is None


def test_waiting_head_that_does_not_fit_blocks_the_queue():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    hog = add(sched, list(range(1, 14)), max_tokens=3)   # 13 tokens: 4 blocks
    step(sched)
    big = add(sched, list(range(20, 30)))                # 3 blocks, 2 free
    small = add(sched, [40])                             # would fit
    out, _ = step(sched)
    assert scheduled_tokens(out) == {hog.seq_id: 1}
    assert list(sched.waiting) == [big, small]
    step(sched)                                          # hog finishes
    out, _ = step(sched)
    assert scheduled_tokens(out) == {big.seq_id: 10, small.seq_id: 1}


def test_max_num_seqs_bounds_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [add(sched, [i]) for i in range(1, 5)]
    out, _ = step(sched)
    assert list(scheduled_tokens(out)) == [s.seq_id for s in seqs[:2]]
    sched.abort(seqs[0].seq_id)
    out, _ = step(sched)
    assert list(scheduled_tokens(out)) == [seqs[1].seq_id, seqs[2].seq_id]


def test_reset_all_worker_state_requeues_everything_in_order():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = add(sched, [1, 2, 3, 4, 5]), add(sched, [6, 7]), add(sched, [8])
    step(sched)
    step(sched)
    sched.abort(a.seq_id)                                # pending for the lost worker: dropped
    a2 = add(sched, [1, 2, 3, 4, 9])                     # would hit a's first block
    step(sched)
    assert list(sched.waiting) == [a2]
    sched.reset_all_worker_state()
    assert list(sched.waiting) == [b, c, a2] and sched.num_running == 0
    assert b.status is SequenceStatus.PREEMPTED and sched.block_manager.num_used_blocks == 0
    assert not sched.block_manager.hash_to_block_id
    out, _ = step(sched)
    assert out.finished_seq_ids == out.preempted_seq_ids == []
    assert [(r.seq_id, r.token_ids, r.num_computed_tokens) for r in out.new_requests] == \
        [(b.seq_id, b.token_ids[:-1], 0), (c.seq_id, c.token_ids[:-1], 0)]


def test_update_skips_stale_results_and_rejects_missing_tokens():
    sched = make_scheduler()
    a, b = add(sched, [1, 2]), add(sched, [3, 4])
    out = sched.schedule()
    with pytest.raises(ValueError):
        sched.update(out, [7])                           # b's token is missing
    assert a.num_tokens == 2 and a.num_placeholder_tokens == 1
    sched.abort(b.seq_id)                                # aborted while the step ran
    assert sched.update(out, by_seq(out, {a.seq_id: 7, b.seq_id: 7})) == [a]
    assert b.num_tokens == 2
    assert sched.update(out, [7, 7]) == []               # the same output twice: ignored
    assert a.num_tokens == 3


def test_config_and_add_are_validated():
    with pytest.raises(ValueError):                      # one request could outgrow the cache
        make_scheduler(num_blocks=4, block_size=4, max_model_len=17)
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    with pytest.raises(ValueError):
        add(sched, list(range(1, 18)))
    with pytest.raises(ValueError):
        add(sched, [1], max_tokens=0)
    seq = add(sched, [1])
    with pytest.raises(ValueError):
        sched.add(seq)                                   # already queued


# -- scheduling ahead: step N+1 is scheduled before step N's result is back ----------------

def test_the_next_step_names_the_decode_of_a_token_still_in_flight():
    sched = make_scheduler(block_size=4)
    seq = add(sched, [1, 2, 3])
    first = sched.schedule()                             # the prompt: samples token 3
    second = sched.schedule()                            # its decode, before token 3 is known
    third = sched.schedule()                             # and the next: position 4 opens block 1
    assert scheduled_tokens(second) == scheduled_tokens(third) == {seq.seq_id: 1}
    assert [r.new_block_ids for r in second.cached_requests] == [[]]
    assert [r.new_block_ids for r in third.cached_requests] == [seq.block_table[1:]]
    assert seq.token_ids == [1, 2, 3] and seq.num_placeholder_tokens == 3
    assert seq.num_computed_tokens == 5
    with pytest.raises(RuntimeError):
        sched.update(second, by_seq(second, {seq.seq_id: 8}))            # results come back in step order
    assert sched.update(first, by_seq(first, {seq.seq_id: 7})) == [seq]
    assert not sched.block_manager.hash_to_block_id      # positions 0..2 computed: no full block
    assert sched.update(second, by_seq(second, {seq.seq_id: 8})) == [seq]
    assert sched.block_manager.hash_to_block_id == {
        sched.block_manager.blocks[seq.block_table[0]].hash: seq.block_table[0]}
    assert sched.update(third, by_seq(third, {seq.seq_id: 9})) == [seq]
    assert seq.token_ids == [1, 2, 3, 7, 8, 9] and seq.num_placeholder_tokens == 0
    assert seq.num_computed_tokens == 5 and sched.update(third, by_seq(third, {seq.seq_id: 9})) == []  # applied


def test_a_request_that_stops_with_its_next_step_in_flight_loses_that_token():
    sched = make_scheduler()
    eos, stop_string, aborted, other = (add(sched, [i, i]) for i in range(1, 5))
    step(sched)
    in_flight = sched.schedule()
    ahead = sched.schedule()
    assert set(scheduled_tokens(ahead)) == {eos.seq_id, stop_string.seq_id, aborted.seq_id, other.seq_id}
    assert sched.update(in_flight, by_seq(in_flight, {s.seq_id: 5 for s in in_flight.sampling_seqs} | {eos.seq_id: EOS})) == \
        [eos, stop_string, aborted, other]
    assert eos.finish_reason is FinishReason.STOP and eos.token_ids == [1, 1, 7, EOS]
    sched.finish(stop_string.seq_id)                     # the detokenizer found a stop string
    sched.abort(aborted.seq_id)
    assert sched.block_manager.num_used_blocks == 1      # only other's block is left
    assert sched.update(ahead, by_seq(ahead, {s.seq_id: 6 for s in ahead.sampling_seqs})) == [other]
    assert eos.token_ids == [1, 1, 7, EOS] and stop_string.token_ids == [2, 2, 7, 5]
    out, _ = step(sched)
    assert out.finished_seq_ids == [eos.seq_id, stop_string.seq_id, aborted.seq_id]
    assert scheduled_tokens(out) == {other.seq_id: 1} and other.token_ids == [4, 4, 7, 5, 6, 7]


def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_again():
    sched = make_scheduler(max_model_len=8)
    capped = add(sched, [1, 2], max_tokens=2)
    edge = add(sched, list(range(1, 8)))                 # its first token reaches max_model_len
    first = sched.schedule()
    ahead = sched.schedule()
    assert scheduled_tokens(ahead) == {capped.seq_id: 1}
    assert sched.update(first, sample(first)) == [capped, edge]
    assert edge.finish_reason is FinishReason.LENGTH
    assert sched.schedule().is_empty                     # capped's last token is in flight
    assert sched.update(ahead, sample(ahead)) == [capped]
    assert capped.finish_reason is FinishReason.LENGTH and capped.num_output_tokens == 2


def test_preempted_with_its_step_in_flight_the_token_is_sampled_again():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, max_model_len=12)
    a = add(sched, [1, 2, 3, 4], max_tokens=3)
    b = add(sched, [5, 6, 7])
    step(sched)                                          # a: 2 blocks from now on, b: 1
    in_flight = sched.schedule()
    ahead = sched.schedule()                             # b's position 4 needs a 4th block: b goes
    assert ahead.preempted_seq_ids == [b.seq_id] and sched.num_preemptions == 1
    # Its own block is free again, so it comes back in this step, without the token in flight.
    (new,) = ahead.new_requests
    assert (new.seq_id, new.token_ids, new.num_computed_tokens, new.num_scheduled_tokens) == \
        (b.seq_id, [5, 6, 7, 7], 0, 4)
    assert scheduled_tokens(ahead) == {a.seq_id: 1, b.seq_id: 4}
    assert sched.update(in_flight, by_seq(in_flight, {a.seq_id: 10, b.seq_id: 11})) == [a]   # b's 11 is stale
    assert b.token_ids == [5, 6, 7, 7]
    assert sched.update(ahead, by_seq(ahead, {a.seq_id: 12, b.seq_id: 11})) == [a, b]    # sampled again
    assert a.token_ids == [1, 2, 3, 4, 7, 10, 12] and a.finish_reason is FinishReason.LENGTH
    assert b.token_ids == [5, 6, 7, 7, 11] and b.num_placeholder_tokens == 0


def test_reset_drops_the_steps_in_flight():
    sched = make_scheduler()
    seq = add(sched, [1, 2, 3])
    first = sched.schedule()
    ahead = sched.schedule()
    sched.reset_all_worker_state()
    assert seq.num_placeholder_tokens == 0
    assert sched.update(first, by_seq(first, {seq.seq_id: 7})) == [] and sched.update(ahead, by_seq(ahead, {seq.seq_id: 8})) == []
    assert seq.token_ids == [1, 2, 3]
    again = sched.schedule()
    (new,) = again.new_requests
    assert (new.token_ids, new.num_computed_tokens, new.num_scheduled_tokens) == ([1, 2, 3], 0, 3)
    assert sched.update(again, by_seq(again, {seq.seq_id: 7})) == [seq] and seq.token_ids == [1, 2, 3, 7]


def test_hand_over_to_another_group_keeps_tokens_and_resends_in_full():
    down, healthy = make_scheduler(max_num_seqs=1), make_scheduler()
    a = add(down, [1, 2, 3, 4, 5])
    waiting = add(down, [6, 7])
    step(down)
    step(down)                                      # a has two output tokens; `waiting` never ran
    assert a.token_ids == [1, 2, 3, 4, 5, 7, 7] and waiting.status is SequenceStatus.WAITING
    moved = down.hand_over()
    assert moved == [a, waiting]
    assert not down.has_unfinished() and down.block_manager.num_free_blocks == down.block_manager.num_blocks
    for seq in moved:
        healthy.adopt(seq)
    out, _ = step(healthy)
    sent = {r.seq_id: list(r.token_ids) for r in out.new_requests}
    assert sent == {a.seq_id: [1, 2, 3, 4, 5, 7, 7], waiting.seq_id: [6, 7]}
    with pytest.raises(ValueError, match="already queued"):
        healthy.adopt(a)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=1)
    running = add(sched, [1], max_tokens=2)
    step(sched)
    low = [add(sched, [10 + i], priority=5) for i in range(3)]
    high = add(sched, [20], priority=-1)                 # arrives last, with the lowest value
    same = add(sched, [30], priority=5)
    assert list(sched.waiting) == [high, *low, same]
    order = []
    while sched.has_unfinished():
        out, _ = step(sched)
        order += [s.seq for s in out.scheduled if s.seq is not running and s.seq not in order]
    assert order == [high, *low, same]


def test_the_lowest_priority_request_is_preempted_first():
    sched = make_scheduler(num_blocks=5, block_size=4)
    background = add(sched, [5, 6, 7], priority=3)       # admitted first, alone
    step(sched)
    urgent, normal = add(sched, [1, 2, 3], priority=-5), add(sched, [9, 10, 11])
    step(sched)
    assert sched.running == [urgent, normal, background]  # the end is preempted first
    preempted = []
    while not preempted:
        out, _ = step(sched)
        preempted = out.preempted_seq_ids
    assert preempted == [background.seq_id] and normal.status is SequenceStatus.RUNNING


def test_a_prompt_whose_logprobs_are_asked_skips_the_prefix_cache_until_it_has_been_scored():
    sched = make_scheduler(block_size=4)
    first = add(sched, list(range(1, 11)), max_tokens=1)
    step(sched)                                          # computed, cached, finished
    plain = add(sched, list(range(1, 11)), max_tokens=1)
    scored = add(sched, list(range(1, 11)), max_tokens=1, prompt_logprobs=True)
    out, _ = step(sched)
    assert {r.seq_id: r.num_computed_tokens for r in out.new_requests} == {plain.seq_id: 8, scored.seq_id: 0}
    assert first.is_finished and scored.num_cached_prompt_tokens == 0


def test_a_waiting_request_is_served_before_later_arrivals_of_any_priority_once_it_has_aged():
    """priority_aging_s 0.01: priority -100 is worth one second of waiting. A priority-0 request
    that arrived at t=0 goes before a -100 one that arrived after t=1, and behind one before."""
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256, block_size=4,
                             priority_aging_s=0.01)
    sched = Scheduler(config, BlockManager(64, 4), eos_token_ids=[EOS])

    def arrive(t: float, priority: int) -> Sequence:
        seq = Sequence(next(_ids), f"t{t}", [int(t * 10) + 3], SamplingParams(max_tokens=1, priority=priority),
                       arrival_time=t)
        sched.add(seq)
        return seq

    patient = arrive(0.0, 0)
    early = [arrive(t, -100) for t in (0.2, 0.9)]
    late = [arrive(t, -100) for t in (1.2, 5.0)]
    urgent_late = arrive(1.5, -100)
    assert list(sched.waiting) == [*early, patient, *late[:1], urgent_late, late[1]]
    strict = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256, block_size=4),
                       BlockManager(64, 4), eos_token_ids=[EOS])
    for seq in (patient, *early, *late):
        strict.add(Sequence(next(_ids), seq.request_id, seq.token_ids, seq.sampling, arrival_time=seq.arrival_time))
    assert [s.request_id for s in strict.waiting][-1] == patient.request_id   # without aging: last, whenever
