"""Scheduler.pause/resume (backpressure from a slow reader): a paused request leaves the batch but
keeps its blocks and its worker mirror, gets the tokens of steps already in flight, gives its
blocks up first when another request needs them, and resumes without a recompute when it can."""
from __future__ import annotations

import pytest

from scheduler_svc.engine.sequence import SequenceStatus
from tests.unit.test_scheduler import add, make_scheduler, sample, scheduled_tokens, step


def test_a_paused_request_leaves_the_batch_and_resumes_where_it_stopped():
    sched = make_scheduler()
    a, b = add(sched, [1, 2, 3]), add(sched, [4, 5, 6])
    step(sched)
    step(sched)
    blocks = list(a.block_table)
    assert sched.pause(a.seq_id) and not sched.pause(a.seq_id)
    for _ in range(3):
        out, received = step(sched)
        assert scheduled_tokens(out) == {b.seq_id: 1} and received == [b]   # b runs on alone
    assert a.block_table == blocks and a.on_worker and a.num_output_tokens == 2
    assert sched.num_running == 1 and sched.num_paused == 1 and sched.has_unfinished()
    assert sched.resume(a.seq_id) and not sched.resume(a.seq_id)
    out, received = step(sched)
    # No NewRequest: the worker still holds its mirror; it decodes its next token.
    assert not out.new_requests and scheduled_tokens(out) == {b.seq_id: 1, a.seq_id: 1}
    assert a.num_output_tokens == 3 and sched.num_preemptions == 0


def test_a_step_in_flight_still_delivers_its_token_to_a_request_paused_meanwhile():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3])
    step(sched)
    out = sched.schedule()                    # a's decode is in flight
    sched.pause(a.seq_id)
    assert sched.update(out, sample(out, 9)) == [a] and a.token_ids[-1] == 9
    assert sched.schedule().is_empty          # nothing more for it until it resumes


def test_a_paused_request_ending_by_length_in_flight_is_released():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3], max_tokens=2)
    step(sched)
    out = sched.schedule()
    sched.pause(a.seq_id)
    sched.update(out, sample(out))
    assert a.is_finished and sched.num_paused == 0 and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_paused_blocks_are_taken_back_before_any_running_request_is_preempted():
    sched = make_scheduler(num_blocks=4, block_size=4)        # 16 slots
    a = add(sched, list(range(1, 8)))                          # 7 tokens: 2 blocks
    step(sched)
    sched.pause(a.seq_id)
    b = add(sched, list(range(20, 31)))                        # 11 tokens: 3 blocks, only 2 are free
    out, _ = step(sched)
    assert scheduled_tokens(out) == {b.seq_id: 11}
    assert a.status is SequenceStatus.PREEMPTED and a.block_table == [] and not a.on_worker
    assert sched.num_preemptions == 1 and sched.num_paused == 1
    out, _ = step(sched)
    assert out.preempted_seq_ids == [] and scheduled_tokens(out) == {b.seq_id: 1}
    sched.finish(b.seq_id)
    # Resumed without its blocks, it is recomputed from its tokens (prefix cache where it can).
    sched.resume(a.seq_id)
    out, received = step(sched)
    assert [r.seq_id for r in out.new_requests] == [a.seq_id] and received == [a]
    assert a.num_output_tokens == 2


def test_resuming_into_a_full_batch_requeues_instead_of_overfilling_it():
    sched = make_scheduler(max_num_seqs=1)
    a = add(sched, [1, 2, 3])
    step(sched)
    sched.pause(a.seq_id)
    b = add(sched, [4, 5, 6])
    step(sched)                                # b took the one slot
    sched.resume(a.seq_id)
    assert sched.num_running == 1 and sched.waiting.head() is a and a.status is SequenceStatus.PREEMPTED
    out, _ = step(sched)
    assert out.preempted_seq_ids == [a.seq_id] and scheduled_tokens(out) == {b.seq_id: 1}


def test_a_worker_reset_frees_a_paused_request_s_blocks_and_it_stays_paused():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3])
    step(sched)
    sched.pause(a.seq_id)
    sched.reset_all_worker_state()
    assert a.paused and a.block_table == [] and a.status is SequenceStatus.PREEMPTED and not a.on_worker
    assert sched.schedule().is_empty
    handed = sched.hand_over()
    assert handed == [a] and a.paused
    other = make_scheduler()
    other.adopt(a)
    assert other.num_paused == 1 and other.schedule().is_empty
    other.resume(a.seq_id)
    assert [r.seq_id for r in other.schedule().new_requests] == [a.seq_id]


def test_an_aborted_paused_request_frees_its_blocks():
    sched = make_scheduler()
    a = add(sched, [1, 2, 3])
    step(sched)
    sched.pause(a.seq_id)
    assert sched.abort(a.seq_id) is a and a.is_finished and not a.paused
    assert sched.num_paused == 0 and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    out = sched.schedule()
    assert out.is_empty


def test_past_what_the_worker_holds_the_longest_paused_lose_their_mirrors():
    # A worker that holds 3 requests at once (WorkerInfo.max_held_requests) beside 2 running: one
    # paused mirror fits; a second pause takes the first one's blocks and mirror back.
    sched = make_scheduler(max_num_seqs=2, max_held_requests=3)
    a, b = add(sched, [1, 2, 3]), add(sched, [4, 5, 6])
    step(sched)
    sched.pause(a.seq_id)
    c = add(sched, [7, 8, 9])
    step(sched)                                # c takes a's slot; a keeps its mirror (3 held)
    assert a.on_worker and a.status is SequenceStatus.RUNNING and sched.num_preemptions == 0
    sched.pause(b.seq_id)
    assert a.status is SequenceStatus.PREEMPTED and not a.on_worker and a.block_table == []
    assert b.on_worker and b.status is SequenceStatus.RUNNING and sched.num_preemptions == 1
    out, _ = step(sched)
    assert out.preempted_seq_ids == [a.seq_id] and scheduled_tokens(out) == {c.seq_id: 1}
    assert sum(s.on_worker for s in (a, b, c)) == 2
    # b resumes where it stopped; a waits for a slot and is then recomputed from its tokens.
    sched.resume(b.seq_id)
    sched.resume(a.seq_id)
    out, _ = step(sched)
    assert not out.new_requests and scheduled_tokens(out) == {c.seq_id: 1, b.seq_id: 1}
    sched.finish(c.seq_id)
    out, _ = step(sched)
    assert [r.seq_id for r in out.new_requests] == [a.seq_id] and a.num_output_tokens == 2


def test_max_held_requests_is_at_least_max_num_seqs():
    with pytest.raises(ValueError, match="max_held_requests 1 is below max_num_seqs 2"):
        make_scheduler(max_num_seqs=2, max_held_requests=1)
