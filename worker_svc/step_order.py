"""Lets one call at a time into the runner, and steps in step_id order.

A scheduler that pipelines sends step N+1 before step N has answered. gRPC hands each call to
its own thread, and nothing stops N+1's thread from reaching the runner first: one worker
would then refuse N+1 (its decodes need N's tokens), and the ranks of a tensor-parallel group
that ran the two in different orders would wait on each other's collectives until they time
out. So a step whose predecessor has not run yet waits for it, briefly: step ids restart with
a new scheduler and a step lost in transit never arrives, so after `wait_s` it runs anyway.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator


class StepOrder:
    def __init__(self, wait_s: float = 1.0) -> None:
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._busy = False
        self._last_step_id: int | None = None   # None: any step may come next

    @contextlib.contextmanager
    def step(self, step_id: int) -> Iterator[None]:
        """Exclusive, once step_id - 1 has run (or wait_s has passed, or it is a lower id)."""
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            while self._busy or not self._in_turn(step_id, deadline):
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0) if not self._busy else None)
            self._busy = True
        try:
            yield
        finally:
            self._release(step_id)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Exclusive, in no order; afterwards any step id may come next (for Reset)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
            self._busy = True
        try:
            yield
        finally:
            self._release(None)

    def _in_turn(self, step_id: int, deadline: float) -> bool:
        last = self._last_step_id
        return last is None or step_id <= last + 1 or time.monotonic() >= deadline

    def _release(self, last_step_id: int | None) -> None:
        with self._cond:
            self._busy = False
            self._last_step_id = last_step_id
            self._cond.notify_all()
