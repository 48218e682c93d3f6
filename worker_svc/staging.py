"""Host/device staging of a step, and its results on their way back.

A step's integer inputs go to the device in one copy from a pinned host buffer (`Staging`); its
sampled tokens come back into pinned slots (`OutputSlots`) behind an event, and `PendingStep`
waits for that event when its result is read, so the host can prepare the next step meanwhile.
Logprobs beyond the sampled token's travel the same way (`Logprobs`).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from worker_svc.runner_io import PromptLogprobs, RequestFailure, StepOutput, TopLogprobs

EMPTY_PART = np.zeros(0, np.int64)   # a staging part with nothing in it
# Launched steps whose tokens may not be read yet: as many as the engine core keeps in flight
# (scheduler_svc/engine/config.py's MOST_STEPS_IN_FLIGHT, 4); one more only adds slack.
OUTPUT_SLOTS = 5
# Host buffers of the step inputs' copy, taken in turn. A buffer is refilled once the step that last used it
# has ended (its done event guards it, `Staging.guard`): one per output slot, so that step is five back, and
# with up to four in flight it has replied before this one was sent (with three, the step three back was
# often still running, and a step's preparation waited for it: v55).
STAGING_BUFFERS = OUTPUT_SLOTS
# An experiment (PERF_NOTES v53, to be measured): each launched step's reply waits for its end in its own thread, so
# with steps in flight several threads sit in cudaEventSynchronize, which spins by default; their polling may slow
# the launching thread's CUDA calls (a one-row step's 50-130 us copies and event records under py-spy on an H100).
# WORKER_BLOCKING_SYNC=1 makes them sleep until the device signals instead.
BLOCKING_SYNC = os.environ.get("WORKER_BLOCKING_SYNC", "0") == "1"


def step_done_event() -> torch.cuda.Event:
    """The event a step's reply waits for (timed against the step's start event)."""
    return torch.cuda.Event(enable_timing=True, blocking=BLOCKING_SYNC)


def to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Starts the copy of a device tensor to the host (finished by the step's event)."""
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    return tensor.to("cpu", non_blocking=True)


@dataclass
class Logprobs:
    """A step's top and prompt logprobs on their way to the host, and what their rows asked."""
    top_ks: np.ndarray | None = None                 # per sampled token
    top_ids: torch.Tensor | None = None              # [asked, max k]
    top_values: torch.Tensor | None = None
    scored: list[tuple[int, int, int, int]] | None = None
    scores: torch.Tensor | None = None               # [scored tokens]
    score_top_ids: torch.Tensor | None = None        # [scored tokens, max k]
    score_top_values: torch.Tensor | None = None

    def top(self) -> TopLogprobs | None:
        if self.top_ks is None:
            return None
        ks = self.top_ks.tolist()
        return columns(ks, [k for k in ks if k], self.top_ids.tolist(), self.top_values.tolist())

    def prompt(self) -> PromptLogprobs | None:
        if self.scored is None or self.scores is None:
            return None
        seq_ids, firsts, counts, ks = (list(column) for column in zip(*self.scored))
        top = None
        if self.score_top_ids is not None:
            token_ks = [k for k, count in zip(ks, counts) for _ in range(count)]
            top = columns(token_ks, token_ks, self.score_top_ids.tolist(), self.score_top_values.tolist())
        return PromptLogprobs(seq_ids, firsts, counts, self.scores.tolist(), top)


def columns(counts: list[int], row_ks: list[int], ids: list[list[int]], values: list[list[float]]) -> TopLogprobs:
    """Packs rows of the max k (row i keeping its first row_ks[i]) into columns with `counts`."""
    flat_ids, flat_values = [], []
    for k, row_ids, row_values in zip(row_ks, ids, values):
        flat_ids += row_ids[:k]
        flat_values += row_values[:k]
    return TopLogprobs(counts, flat_ids, flat_values)


class PendingStep:
    """A launched step; result() waits (without the interpreter lock) for its tokens."""

    def __init__(self, step_id: int, started: float, prepare_ms: float, forward_ms: float, num_sampled: int,
                 tokens: torch.Tensor | None, logprobs: torch.Tensor | None, event, release,
                 device_start=None, extra: Logprobs | None = None,
                 finish: Callable[[StepOutput], StepOutput] | None = None) -> None:
        self.step_id = step_id
        self._started = started
        self._prepare_ms, self._forward_ms = prepare_ms, forward_ms
        self._num_sampled = num_sampled
        self._tokens, self._logprobs, self._event, self._release = tokens, logprobs, event, release
        self._device_start = device_start
        self._extra = extra
        self.failed: list[RequestFailure] = []     # requests given up on in this step
        self._finish = finish       # turns a speculative step's sampled positions into its reply

    def result(self) -> StepOutput:
        try:
            if self._event is not None:
                self._event.synchronize()
            n = self._num_sampled
            tokens = self._tokens[:n].tolist() if n else []
            logprobs = self._logprobs[:n].tolist() if self._logprobs is not None and n else None
            extra = self._extra
            top = extra.top() if extra is not None else None
            prompt = extra.prompt() if extra is not None else None
            device_ms = self._device_start.elapsed_time(self._event) if self._device_start is not None else 0.0
            output = StepOutput(self.step_id, tokens, logprobs, self._prepare_ms, self._forward_ms,
                                (time.perf_counter() - self._started) * 1e3, device_ms, top, prompt, tuple(self.failed))
            if self._finish is not None:   # before the slot is released: it reads the tokens there
                output = self._finish(output)
        finally:
            if self._release is not None:
                self._release()
                self._release = None
        return output


class OutputSlots:
    """Pinned host buffers the device copies sampled tokens into, one per launched step whose
    result is not read yet, so step N+1's copy never lands on N's before N's reply reads it."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.tokens = [torch.empty(capacity, dtype=torch.int64, pin_memory=pin) for _ in range(OUTPUT_SLOTS)]
        self.logprobs = [torch.empty(capacity, dtype=torch.float32, pin_memory=pin) for _ in range(OUTPUT_SLOTS)]
        self._free = list(range(OUTPUT_SLOTS))
        self._cond = threading.Condition()

    def acquire(self) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._free)
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()


class Staging:
    """One host buffer per step holding every integer input, copied to the device in one go.
    STAGING_BUFFERS pinned buffers are taken in turn; before refilling one the host waits for the event of
    the step that copied from it last (`guard`: its done event, recorded after the copy on the same stream),
    or, for a step that recorded none, an event of the buffer's own recorded at the next fill: one CUDA call
    a step fewer than an event per copy (on a slow host each costs 50-130 us, PERF_NOTES v53). That step is
    STAGING_BUFFERS back, more than the engine keeps in flight, so it has replied: it never waits in practice."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.cuda)
                     for _ in range(STAGING_BUFFERS if self.cuda else 1)]
        self.events = [None] * len(self.host)
        self._own_events = [None] * len(self.host)
        self._unguarded = None      # the buffer copied last, while no event guards it yet
        # The worker enqueues everything on the device's current stream (it never sets one): asked once, since
        # asking makes a Stream object each time.
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.on_device = torch.empty(capacity, dtype=torch.int64, device=device) if self.cuda else None
        self._next = 0

    def guard(self, event) -> None:
        """`event`, recorded on the stream after the last fill's copy, now guards that copy's buffer."""
        if self._unguarded is not None:
            self.events[self._unguarded] = event
            self._unguarded = None

    def _guard_unguarded(self) -> None:
        """An event of the buffer's own behind its copy (stream order: recorded after it), when no step's came."""
        i, self._unguarded = self._unguarded, None
        event = self._own_events[i] = self._own_events[i] or torch.cuda.Event()
        event.record(self.stream)
        self.events[i] = event

    def fill(self, parts: list[np.ndarray], offsets: list[int] = (), first_view: int = 0) -> list[torch.Tensor]:
        """Copies the parts to the device in one transfer; returns device views of each from parts[first_view]
        on (a staged decode reads its columns in the graph, and a view costs a few us). The first
        len(offsets) parts go each at its offset (a layout its reader fixed), the others one after
        the other behind them."""
        i = self._next
        self._next = (i + 1) % len(self.host)
        if self._unguarded is not None:
            self._guard_unguarded()
        # Asked first: synchronize lets go of the interpreter lock, and taking it back can wait for another
        # thread's Python (a reply being built) while this step's launch waits (PERF_NOTES v52).
        if self.events[i] is not None and not self.events[i].query():
            self.events[i].synchronize()
        host = self.host[i]
        view = host.numpy()
        sizes = [len(p) for p in parts]
        offsets = list(offsets)
        end = max((offset + size for offset, size in zip(offsets, sizes)), default=0)
        for size in sizes[len(offsets):]:
            offsets.append(end)
            end += size
        for part, offset, size in zip(parts, offsets, sizes):
            view[offset:offset + size] = part
        if self.cuda:
            self.on_device[:end].copy_(host[:end], non_blocking=True)
            self.events[i], self._unguarded = None, i
            flat = self.on_device
        else:
            flat = host[:end].clone()
        return [flat[offset:offset + size] for offset, size in zip(offsets[first_view:], sizes[first_view:])]
