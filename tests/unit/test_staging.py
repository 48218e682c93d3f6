"""Host/device staging (worker_svc/staging.py) on the CPU: a step's parts travel in one buffer
and come back intact, a step's views survive the next step's fill, a launch waits for a free
output slot once every slot holds an unread step, and logprob columns keep each row's k."""
from __future__ import annotations

import threading

import numpy as np
import torch

from worker_svc.runner_io import TopLogprobs
from worker_svc.staging import EMPTY_PART, OUTPUT_SLOTS, Logprobs, OutputSlots, PendingStep, Staging

CPU = torch.device("cpu")


def test_every_part_comes_back_intact_from_one_buffer():
    staging = Staging(64, CPU)
    parts = [np.arange(5), EMPTY_PART, np.array([7, -1, 9]), np.arange(10, 30)]
    views = staging.fill(parts)
    assert [v.tolist() for v in views] == [p.tolist() for p in parts]
    assert {v.untyped_storage().data_ptr() for v in views} == {views[0].untyped_storage().data_ptr()}


def test_parts_given_offsets_land_there():
    staging = Staging(64, torch.device("cpu"))
    views = staging.fill([np.array([1, 2]), np.array([3]), np.array([4, 5, 6])], [0, 10, 3])
    assert [v.tolist() for v in views] == [[1, 2], [3], [4, 5, 6]]


def test_parts_after_those_given_offsets_follow_the_last_of_them():
    staging = Staging(64, CPU)
    views = staging.fill([np.array([1, 2]), np.array([3]), np.arange(4, 7), EMPTY_PART, np.array([8])], [0, 10])
    assert [v.tolist() for v in views] == [[1, 2], [3], [4, 5, 6], [], [8]]
    assert staging.host[0][11:15].tolist() == [4, 5, 6, 8]


def test_a_steps_views_survive_the_next_steps_fill():
    staging = Staging(16, CPU)
    first = staging.fill([np.arange(4), np.arange(4, 8)])
    staging.fill([np.full(8, 99)])
    assert [v.tolist() for v in first] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_worker_holds_a_slot_and_buffers_for_every_step_the_engine_keeps_in_flight():
    """The engine core keeps up to MOST_STEPS_IN_FLIGHT steps in flight (a fourth at the fewest requests):
    each launched step holds an output slot until its reply is read, and a step refills the staging
    buffer of the step STAGING_BUFFERS back, which must have ended (its done event guards the buffer):
    with more buffers than steps in flight, that step replied before this one was sent."""
    from scheduler_svc.engine.config import MOST_STEPS_IN_FLIGHT
    from worker_svc.staging import STAGING_BUFFERS

    assert OUTPUT_SLOTS > MOST_STEPS_IN_FLIGHT and STAGING_BUFFERS > MOST_STEPS_IN_FLIGHT


def test_a_launch_waits_for_a_free_output_slot_once_every_slot_holds_an_unread_step():
    slots = OutputSlots(8, CPU)
    taken = [slots.acquire() for _ in range(OUTPUT_SLOTS)]
    assert sorted(taken) == list(range(OUTPUT_SLOTS))
    got = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire()))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got
    slots.release(taken[1])
    waiter.join()
    assert got == [taken[1]]


def test_a_pending_steps_result_reads_its_tokens_and_frees_its_slot_once():
    released = []
    tokens = torch.tensor([11, 12, 13, 0, 0])
    logprobs = torch.tensor([-0.5, -1.0, -2.0, 0.0, 0.0])
    pending = PendingStep(4, 0.0, 1.5, 2.5, 3, tokens, logprobs, None, lambda: released.append(1))
    output = pending.result()
    assert (output.step_id, output.token_ids, output.logprobs) == (4, [11, 12, 13], [-0.5, -1.0, -2.0])
    assert (output.prepare_ms, output.forward_ms, output.top_logprobs, output.prompt_logprobs) == (1.5, 2.5, None, None)
    assert released == [1]


def test_top_logprob_columns_keep_each_rows_k():
    extra = Logprobs(top_ks=np.array([2, 0, 1]), top_ids=torch.tensor([[5, 6], [7, 8]]),
                     top_values=torch.tensor([[-0.5, -1.5], [-0.25, -4.0]]))
    assert extra.top() == TopLogprobs([2, 0, 1], [5, 6, 7], [-0.5, -1.5, -0.25])


def test_prompt_logprobs_come_per_scored_request_with_their_tops():
    extra = Logprobs(scored=[(3, 1, 2, 1), (4, 5, 1, 2)], scores=torch.tensor([-1.0, -2.0, -3.0]),
                     score_top_ids=torch.tensor([[1, 2], [3, 4], [5, 6]]),
                     score_top_values=torch.tensor([[-0.5, -1.5], [-0.25, -4.0], [-0.75, -2.0]]))
    prompt = extra.prompt()
    assert (prompt.seq_ids, prompt.first_positions, prompt.counts) == ([3, 4], [1, 5], [2, 1])
    assert prompt.logprobs == [-1.0, -2.0, -3.0]
    assert prompt.top == TopLogprobs([1, 1, 2], [1, 3, 5, 6], [-0.5, -0.25, -0.75, -2.0])
    assert Logprobs().top() is None and Logprobs().prompt() is None


class _Event:
    def __init__(self, done: bool) -> None:
        self.done, self.synchronized = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1


def test_a_fill_waits_for_its_buffers_last_copy_only_when_that_copy_is_not_done():
    """Asking first keeps the interpreter lock: synchronize lets it go, and a step's launch then waits to
    get it back from another thread (PERF_NOTES v52)."""
    staging = Staging(16, CPU)
    for done, waits in ((True, 0), (False, 1)):
        event = _Event(done)
        staging.events[0] = event
        staging._next = 0
        staging.fill([np.arange(3)])
        assert event.synchronized == waits


class _RecordedEvent(_Event):
    """A CUDA event as the staging uses it: recorded on a stream, done once asked to be."""
    def __init__(self) -> None:
        super().__init__(done=False)
        self.records = []

    def record(self, stream=None) -> None:
        self.records.append(stream)


def _staging_as_on_a_gpu(monkeypatch) -> tuple[Staging, list]:
    """A Staging taking the device's branch with CPU tensors: three host buffers, a device buffer, made events."""
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **flags: made.append(_RecordedEvent()) or made[-1])
    staging = Staging(16, CPU)
    staging.cuda, staging.stream = True, "stream"
    staging.host = [torch.zeros(16, dtype=torch.int64) for _ in range(3)]
    staging.events, staging._own_events = [None] * 3, [None] * 3
    staging.on_device = torch.zeros(16, dtype=torch.int64)
    return staging, made


def test_a_buffers_copy_is_guarded_by_its_steps_event_and_a_refill_waits_for_it(monkeypatch):
    """One event a step, not two (PERF_NOTES v55): the step's done event, recorded behind its input copy, is
    what the buffer's next fill waits for; the staging records none of its own."""
    staging, made = _staging_as_on_a_gpu(monkeypatch)
    steps = []
    for step in range(3):
        assert staging.fill([np.arange(step, step + 4)])[0].tolist() == list(range(step, step + 4))
        steps.append(_Event(done=False))
        staging.guard(steps[-1])
    assert made == [] and staging.events == steps
    staging.fill([np.arange(2)])            # buffer 0 again: its step is still running
    assert [e.synchronized for e in steps] == [1, 0, 0]
    steps[1].done = True
    staging.fill([np.arange(2)])            # buffer 1: its step is done, nothing waits
    assert steps[1].synchronized == 0


def test_a_copy_no_step_event_guarded_gets_the_buffers_own_event_at_the_next_fill(monkeypatch):
    """A step that records no done event (it sampled nothing): its copy is guarded by an event recorded at the
    next fill, on the stream after that copy; the buffer keeps that event for its later copies."""
    staging, made = _staging_as_on_a_gpu(monkeypatch)
    staging.fill([np.arange(3)])                     # buffer 0, no guard follows
    assert made == [] and staging.events == [None] * 3
    staging.fill([np.arange(3)])                     # buffer 1: buffer 0's own event is recorded first
    assert len(made) == 1 and made[0].records == ["stream"] and staging.events[0] is made[0]
    step1 = _Event(done=True)
    staging.guard(step1)
    assert staging.events[1] is step1
    staging.fill([np.arange(3)])                     # buffer 2, unguarded
    staging.fill([np.arange(3)])                     # buffer 0 again: buffer 2's own event, then the wait on 0's
    assert len(made) == 2 and made[1].records == ["stream"] and staging.events[2] is made[1]
    assert made[0].synchronized == 1
    staging.fill([np.arange(3)])                     # buffer 1: buffer 0's own event recorded again, not a new one
    assert len(made) == 2 and made[0].records == ["stream", "stream"] and step1.synchronized == 0


def test_a_steps_done_event_sleeps_in_its_wait_only_when_asked(monkeypatch):
    """WORKER_BLOCKING_SYNC (PERF_NOTES v53): the event a step's reply waits for is created blocking (its waiter
    sleeps until the device signals) only when asked; timed either way (the step's device time)."""
    from worker_svc import staging

    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **flags: made.append(flags) or flags)
    for blocking in (False, True):
        monkeypatch.setattr(staging, "BLOCKING_SYNC", blocking)
        assert staging.step_done_event() == {"enable_timing": True, "blocking": blocking}
    assert len(made) == 2


def test_a_fill_returns_views_from_the_first_part_asked():
    staging = Staging(32, CPU)
    parts = [np.arange(3), np.arange(10, 12), np.arange(20, 24)]
    assert [v.tolist() for v in staging.fill(parts, first_view=1)] == [[10, 11], [20, 21, 22, 23]]
    assert [v.tolist() for v in staging.fill(parts, [5], first_view=2)] == [[20, 21, 22, 23]]
    assert staging.fill(parts, first_view=3) == []
