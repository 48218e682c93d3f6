"""Lets one call at a time into the runner, and steps in step_id order.

A scheduler that pipelines sends step N+1 before step N has answered. gRPC hands each call to
its own thread, and nothing stops N+1's thread from reaching the runner first: one worker
would then refuse N+1 (its decodes need N's tokens), and the ranks of a tensor-parallel group
that ran the two in different orders would wait on each other's collectives until they time
out. So a step ahead of its turn waits for the ones before it, but only for `wait_s`: a step
lost in transit never arrives. Once that wait is over, the lowest id waiting goes first, so
steps that arrived within `wait_s` of each other still run in order. A lower id than expected
(a new scheduler's count) runs at once.

At start and after a Reset the next step is 1. A scheduler that keeps counting across a
Reset is still served in order, after one `wait_s` on the first step that follows it. A call
refused in its turn (a step or reset of a scheduler that lost the worker's lease) leaves the
count as it was: its ids belong to another scheduler's sequence.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator


class Turn:
    """One call's turn; skip() when the call was refused, so its id does not count."""
    __slots__ = ("skipped",)

    def __init__(self) -> None:
        self.skipped = False

    def skip(self) -> None:
        self.skipped = True


class StepOrder:
    def __init__(self, wait_s: float = 1.0) -> None:
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._busy = False
        self._next_step_id = 1
        self._waiting: set[int] = set()

    @contextlib.contextmanager
    def step(self, step_id: int) -> Iterator[Turn]:
        """Exclusive, in its turn."""
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            self._waiting.add(step_id)
            while not self._may_run(step_id, deadline):
                early = not self._busy and time.monotonic() < deadline
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0) if early else None)
            self._waiting.discard(step_id)
            self._busy = True
        turn = Turn()
        try:
            yield turn
        finally:
            self._release(None if turn.skipped else step_id + 1)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[Turn]:
        """Exclusive, in no order; afterwards step 1 is next (for Reset)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
            self._busy = True
        turn = Turn()
        try:
            yield turn
        finally:
            self._release(None if turn.skipped else 1)

    def _may_run(self, step_id: int, deadline: float) -> bool:
        if self._busy:
            return False
        if step_id <= self._next_step_id:
            return True
        return time.monotonic() >= deadline and step_id == min(self._waiting)

    def _release(self, next_step_id: int | None) -> None:
        with self._cond:
            self._busy = False
            if next_step_id is not None:
                self._next_step_id = next_step_id
            self._cond.notify_all()
