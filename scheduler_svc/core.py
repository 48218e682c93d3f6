"""The engine core: admits requests from its frontends, routes each to a worker group, runs the
groups' step loops and publishes, per step, one packed StepOutputs per frontend.

The core holds no tokenizer and writes no client stream: that per-token work belongs to the
frontends (scheduler_svc/frontend.py), in processes of their own, so the core's Python per step
is the scheduling and O(batch) list building. Everything runs on one event loop: request state
needs no locks.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from scheduler_svc.core_types import (ADDED, AddCode, AddResult, CoreEvent, CoreInfo, CoreRequest, CoreStatus,
                                      FinishedRequest, GroupState, StepOutputs, frontend_of)
from scheduler_svc.group_runner import EngineConfig, GroupHooks, GroupRunner
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.scheduler import SchedulerOutput
from scheduler_svc.sequence import FinishReason, Sequence
from scheduler_svc.step_message import StepResult
from scheduler_svc.worker_client import WorkerGroupClient

log = logging.getLogger("scheduler.core")

__all__ = ["EngineCore", "EngineConfig"]


@dataclass(slots=True)
class _Active:
    seq: Sequence
    group: GroupRunner
    first_token_at: float | None = None


class EngineCore:
    def __init__(self, groups: list[WorkerGroupClient], *, eos_token_ids: list[int],
                 config: EngineConfig | None = None, metrics: SchedulerMetrics | None = None) -> None:
        if not groups:
            raise ValueError("the engine needs at least one worker group")
        self.config = config or EngineConfig()
        self.eos_token_ids = list(eos_token_ids)
        self.metrics = metrics or SchedulerMetrics()
        hooks = GroupHooks(on_connected=self._on_connected, on_step=self._on_step, on_down=self._on_down,
                           on_waiting=lambda group: self._publish_status())
        self.groups = [GroupRunner(i, g, self.config, self.eos_token_ids, self.metrics, hooks)
                       for i, g in enumerate(groups)]
        self._active: dict[int, _Active] = {}                  # seq_id -> request in flight
        self._by_request_id: dict[str, int] = {}
        self._subscribers: dict[int, asyncio.Queue[CoreEvent]] = {}
        self._draining = False
        self._started = False
        self._status = self._compute_status()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts every group's loop; each connects on its own (waiting for workers that are
        still starting), and the core accepts requests once one is up."""
        self._started = True
        for group in self.groups:
            group.start()
        self._publish_status()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Waits until a group is up; False when none came up within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self._status.accepting and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._status.accepting

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stops admitting, lets running requests finish for grace_s, then aborts the rest."""
        self._draining = True
        self._publish_status()
        deadline = time.monotonic() + grace_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for seq_id in list(self._active):
            self._end(seq_id, FinishReason.ABORT, notify=True)
        for group in self.groups:
            await group.stop()
            await group.client.close()

    @property
    def status(self) -> CoreStatus:
        return self._status

    def _compute_status(self) -> CoreStatus:
        up = [g for g in self.groups if g.healthy]
        max_model_len = min((g.max_model_len for g in up), default=0)
        if self._draining:
            return CoreStatus(False, "the server is shutting down", max_model_len)
        if not up:
            if any(g.scheduler for g in self.groups):
                reason = "every worker group is down; requests wait for one to come back"
            else:
                reason = "no worker group is ready yet (workers still starting or unreachable)"
            # Why each waits, e.g. a worker leased to another scheduler (which one says who).
            reason += "".join(f"; group {g.index}: {g.down_reason}" for g in self.groups if g.down_reason)
            known = min((g.max_model_len for g in self.groups if g.scheduler), default=0)
            return CoreStatus(False, reason, known)
        return CoreStatus(True, "", max_model_len)

    def _publish_status(self) -> None:
        status = self._compute_status()
        if status != self._status:
            self._status = status
            for queue in self._subscribers.values():
                queue.put_nowait(CoreEvent(status=status))

    # -- frontends --------------------------------------------------------------------------
    def attach(self, frontend_id: int) -> asyncio.Queue[CoreEvent]:
        """The frontend's event queue, starting with the current status. A frontend that attaches
        again (restarted) replaces its old queue; its old requests are gone with it."""
        if frontend_id in self._subscribers:
            self.detach(frontend_id, self._subscribers[frontend_id])
        queue: asyncio.Queue[CoreEvent] = asyncio.Queue()
        queue.put_nowait(CoreEvent(status=self._status))
        self._subscribers[frontend_id] = queue
        return queue

    def detach(self, frontend_id: int, queue: asyncio.Queue[CoreEvent]) -> bool:
        """The frontend whose events went to `queue` went away: nobody reads its requests' tokens
        any more. False (nothing done) when the frontend has attached again since."""
        if self._subscribers.get(frontend_id) is not queue:
            return False
        del self._subscribers[frontend_id]
        orphans = [seq_id for seq_id in self._active if frontend_of(seq_id) == frontend_id]
        for seq_id in orphans:
            self._end(seq_id, FinishReason.ABORT, notify=False)
        if orphans:
            log.warning("frontend %d went away: aborted its %d requests", frontend_id, len(orphans))
        return True

    def add_requests(self, requests: list[CoreRequest]) -> list[AddResult]:
        return [self._add(r) for r in requests]

    def _add(self, request: CoreRequest) -> AddResult:
        if self._draining:
            return AddResult(AddCode.UNAVAILABLE, "the server is shutting down")
        if request.request_id in self._by_request_id:
            return AddResult(AddCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already in flight")
        if request.seq_id in self._active:
            return AddResult(AddCode.ALREADY_EXISTS, f"seq_id {request.seq_id} is already in flight")
        group = self._route(request.prompt_token_ids)
        if group is None:
            return AddResult(AddCode.UNAVAILABLE, self._status.reason or "no worker group is ready")
        if self.num_waiting() >= self.config.max_waiting:
            return AddResult(AddCode.RESOURCE_EXHAUSTED,
                             f"{self.config.max_waiting} requests are already waiting; retry later")
        seq = Sequence(request.seq_id, request.request_id, request.prompt_token_ids, request.sampling)
        try:
            group.scheduler.add(seq)
        except ValueError as e:          # longer than this group's context limit
            return AddResult(AddCode.INVALID_ARGUMENT, str(e))
        self._active[seq.seq_id] = _Active(seq, group)
        self._by_request_id[seq.request_id] = seq.seq_id
        group.wake()
        return ADDED

    def abort(self, seq_ids: list[int], reason: FinishReason = FinishReason.ABORT, notify: bool = False) -> None:
        """Ends a frontend's own requests; with notify, each ending comes back as an event."""
        for seq_id in seq_ids:
            if seq_id in self._active:
                self._end(seq_id, reason, notify=notify)

    def abort_request_id(self, request_id: str) -> bool:
        """Ends a request by its public id, from whichever frontend; its own frontend hears of it."""
        seq_id = self._by_request_id.get(request_id)
        if seq_id is None:
            return False
        self._end(seq_id, FinishReason.ABORT, notify=True)
        return True

    def set_paused(self, pause: list[int], resume: list[int]) -> None:
        """Backpressure from a frontend: its clients of `pause` fell a window behind (their
        requests leave the batch), those of `resume` caught up. Ids no longer in flight are
        ignored (the request ended meanwhile)."""
        for seq_id in pause:
            entry = self._active.get(seq_id)
            if entry is not None:
                entry.group.scheduler.pause(seq_id)
        for seq_id in resume:
            entry = self._active.get(seq_id)
            if entry is not None and entry.group.scheduler.resume(seq_id):
                entry.group.wake()

    def info(self) -> CoreInfo:
        groups = []
        for g in self.groups:
            s, info = g.scheduler, g.info
            bm = s.block_manager if s else None
            groups.append(GroupState(
                addresses=g.client.addresses, healthy=g.healthy,
                num_kv_blocks=bm.num_blocks if bm else 0, num_free_kv_blocks=bm.num_free_blocks if bm else 0,
                num_running=s.num_running if s else 0, num_waiting=s.num_waiting if s else 0,
                device=info.device if info else "", attention_backend=info.attention_backend if info else "",
                num_preemptions=s.num_preemptions if s else 0,
                prefix_cache_queried_tokens=bm.prefix_cache_queried_tokens if bm else 0,
                prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens if bm else 0,
                block_size=info.block_size if info else 0, max_model_len=g.max_model_len,
                num_paused=s.num_paused if s else 0,
            ))
        return CoreInfo(self._status, groups)

    def num_waiting(self) -> int:
        return sum(g.scheduler.num_waiting for g in self.groups if g.scheduler)

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- routing ----------------------------------------------------------------------------
    def _route(self, prompt_token_ids: list[int]) -> GroupRunner | None:
        """The healthy group holding the longest cached prefix of the prompt; ties go to the
        least loaded. With every group down, the least loaded one that has been up queues it
        until it is back; with none ever up, None."""
        candidates = [g for g in self.groups if g.healthy] or [g for g in self.groups if g.scheduler]
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        return max(candidates, key=lambda g: (g.scheduler.block_manager.cached_prefix_len(prompt_token_ids), -g.load))

    # -- group hooks --------------------------------------------------------------------------
    def _on_connected(self, group: GroupRunner) -> None:
        self._publish_status()
        group.wake()

    def _on_down(self, down: GroupRunner) -> None:
        """Moves a down group's requests to the healthy groups (by the same routing as new
        requests), where they are recomputed from their tokens; with no healthy group they stay
        and wait for this one to come back."""
        self._publish_status()
        if not any(g.healthy for g in self.groups):
            return
        moved = down.scheduler.hand_over()
        for seq in moved:
            active = self._active[seq.seq_id]
            active.group = self._route(seq.token_ids)
            active.group.scheduler.adopt(seq)
            active.group.wake()
        if moved:
            log.warning("group %d is down: %d requests moved to healthy groups", down.index, len(moved))

    def _on_step(self, group: GroupRunner, output: SchedulerOutput, received: list[Sequence],
                 result: StepResult) -> None:
        """Packs the tokens a step brought into one StepOutputs per frontend."""
        if not received:
            return
        self.metrics.observe_sampled(len(received))
        now = time.monotonic()
        per_frontend: dict[int, StepOutputs] = {}
        logprob_of = (dict(zip((s.seq_id for s in output.sampling_seqs), result.logprobs))
                      if result.logprobs is not None else None)
        active = self._active
        for seq in received:
            seq_id = seq.seq_id
            entry = active.get(seq_id)
            if entry is None:
                continue
            outputs = per_frontend.get(frontend_of(seq_id))
            if outputs is None:
                outputs = per_frontend[frontend_of(seq_id)] = StepOutputs(
                    logprobs=[] if logprob_of is not None else None)
            outputs.seq_ids.append(seq_id)
            outputs.token_ids.append(seq.token_ids[-1])
            if logprob_of is not None:
                outputs.logprobs.append(logprob_of[seq_id])
            if entry.first_token_at is None:
                entry.first_token_at = now
            if seq.finish_reason is not None:
                outputs.finished.append(self._forget(seq_id))
        for frontend_id, outputs in per_frontend.items():
            queue = self._subscribers.get(frontend_id)
            if queue is not None:
                queue.put_nowait(CoreEvent(outputs=outputs))

    # -- endings ----------------------------------------------------------------------------
    def _end(self, seq_id: int, reason: FinishReason, *, notify: bool) -> None:
        """Ends a request the scheduler still runs (abort, stop string, shutdown)."""
        entry = self._active[seq_id]
        entry.group.scheduler.finish(seq_id, reason)
        entry.group.wake()
        finished = self._forget(seq_id)
        if notify:
            queue = self._subscribers.get(frontend_of(seq_id))
            if queue is not None:
                queue.put_nowait(CoreEvent(outputs=StepOutputs(finished=[finished])))

    def _forget(self, seq_id: int) -> FinishedRequest:
        entry = self._active.pop(seq_id)
        seq = entry.seq
        self._by_request_id.pop(seq.request_id, None)
        reason = seq.finish_reason or FinishReason.ABORT
        self.metrics.observe_request(reason.value, seq.arrival_time, entry.first_token_at,
                                     seq.num_prompt_tokens, seq.num_output_tokens)
        # Logged from the step loop, which serves many requests: name this one explicitly.
        log.info("finished (%s): %d prompt tokens (%d cached), %d generated", reason.value, seq.num_prompt_tokens,
                 seq.num_cached_prompt_tokens, seq.num_output_tokens, extra={"request_id": seq.request_id})
        return FinishedRequest(seq_id, reason, seq.num_output_tokens, seq.num_cached_prompt_tokens)
