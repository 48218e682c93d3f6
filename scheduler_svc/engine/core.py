"""The engine core: admits requests from its frontends, routes each to a worker group, runs the
groups' step loops and publishes, per step, one packed StepOutputs per frontend.

The core holds no tokenizer and writes no client stream: that per-token work belongs to the
frontends (scheduler_svc/frontend/streams.py), in processes of their own, so the core's Python per step
is the scheduling and O(batch) list building. Everything runs on one event loop: request state
needs no locks.

The samples of one request (n > 1) arrive as sequences sharing its request_id. Samples 1.. added
while sample 0's prompt is still being computed are deferred: they join sample 0's group once it
has its first token, when the prompt's full blocks are in the prefix cache, so the prompt is
computed once and its blocks shared (their usage shows the cached tokens).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from scheduler_svc.engine.api import (ADDED, AddCode, AddResult, CoreEvent, CoreInfo, CoreRequest, CoreStatus,
                                      FinishedRequest, GroupState, PromptLogprobs, RequestError, StepOutputs,
                                      TopLogprobColumns, frontend_of)
from common.features import Feature
from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.engine.group_runner import GroupHooks, GroupRunner
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.step_log import StepLog
from scheduler_svc.engine.scheduler_output import SchedulerOutput
from scheduler_svc.engine.sequence import FinishReason, Sequence
from scheduler_svc.engine.speculation import SpeculationConfig
from scheduler_svc.engine.step_message import StepPromptLogprobs, StepResult
from scheduler_svc.engine.worker_client import WorkerGroupClient

logger = logging.getLogger(__name__)

__all__ = ["EngineCore", "EngineConfig"]


@dataclass(slots=True)
class _Active:
    seq: Sequence
    group: GroupRunner
    sample_index: int = 0
    first_token_at: float | None = None
    # Samples of the same request waiting for this one's prompt to be computed (see the module
    # docstring), and, for such a sample, the seq_id of the one it waits for.
    deferred: list[Sequence] = field(default_factory=list)
    waits_for: int | None = None
    prompt_scored: int = 0       # prompt tokens whose logprobs were sent (prompt_logprobs)
    preparing: bool = False      # its grammar is being compiled: not queued yet


class EngineCore:
    def __init__(self, groups: list[WorkerGroupClient], *, eos_token_ids: list[int],
                 config: EngineConfig | None = None, metrics: SchedulerMetrics | None = None) -> None:
        if not groups:
            raise ValueError("the engine needs at least one worker group")
        self.config = config or EngineConfig()
        self.eos_token_ids = list(eos_token_ids)
        self.metrics = metrics or SchedulerMetrics()
        hooks = GroupHooks(on_connected=self._on_connected, on_step=self._on_step, on_down=self._on_down,
                           on_waiting=lambda group: self._publish_status(), on_failed=self._on_failed)
        self.step_log = StepLog(self.config.step_log) if self.config.step_log else None
        self.groups = [GroupRunner(i, g, self.config, self.eos_token_ids, self.metrics, hooks, self.step_log)
                       for i, g in enumerate(groups)]
        self._active: dict[int, _Active] = {}                  # seq_id -> request in flight
        self._by_request_id: dict[str, list[int]] = {}         # the samples in flight
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
        if self.step_log is not None:
            self.step_log.close()

    @property
    def status(self) -> CoreStatus:
        return self._status

    def _compute_status(self) -> CoreStatus:
        up = [g for g in self.groups if g.healthy]
        max_model_len = min((g.max_model_len for g in up), default=0)
        features = self._features()
        if self._draining:
            return CoreStatus(False, "the server is shutting down", max_model_len, features)
        if not up:
            if any(g.scheduler for g in self.groups):
                reason = "every worker group is down; requests wait for one to come back"
            else:
                reason = "no worker group is ready yet (workers still starting or unreachable)"
            # Why each waits, e.g. a worker leased to another scheduler (which one says who).
            reason += "".join(f"; group {g.index}: {g.down_reason}" for g in self.groups if g.down_reason)
            known = min((g.max_model_len for g in self.groups if g.scheduler), default=0)
            return CoreStatus(False, reason, known, features)
        return CoreStatus(True, "", max_model_len, features)

    def _features(self) -> tuple[Feature, ...]:
        """Each optional feature, available when every group that has described itself serves it
        (a request may go to any of them); else the first group's reason."""
        per_group = [g.features for g in self.groups if g.info is not None]
        merged: dict[str, Feature] = {}
        for features in per_group:
            for feature in features:
                if feature.name not in merged or (merged[feature.name].available and not feature.available):
                    merged[feature.name] = feature
        return tuple(merged.values())

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
            logger.warning("frontend %d went away: aborted its %d requests", frontend_id, len(orphans))
        return True

    def add_requests(self, requests: list[CoreRequest]) -> list[AddResult]:
        return [self._add(r) for r in requests]

    def _add(self, request: CoreRequest) -> AddResult:
        if self._draining:
            return AddResult(AddCode.UNAVAILABLE, "the server is shutting down")
        samples = self._by_request_id.get(request.request_id, ())
        if samples and (request.sample_index == 0 or
                        any(self._active[s].sample_index == request.sample_index for s in samples)):
            return AddResult(AddCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already in flight")
        if request.seq_id in self._active:
            return AddResult(AddCode.ALREADY_EXISTS, f"seq_id {request.seq_id} is already in flight")
        leader = self._computing_prompt_of(request, samples)
        group = leader.group if leader is not None else self._route(request.prompt_token_ids)
        if group is None:
            return AddResult(AddCode.UNAVAILABLE, self._status.reason or "no worker group is ready")
        if self.num_waiting() >= self.config.max_waiting:
            return AddResult(AddCode.RESOURCE_EXHAUSTED,
                             f"{self.config.max_waiting} requests are already waiting; retry later")
        seq = Sequence(request.seq_id, request.request_id, request.prompt_token_ids, request.sampling)
        entry = _Active(seq, group, request.sample_index)
        if leader is not None:           # the same prompt as the leader's: it fits where that did
            leader.deferred.append(seq)
            entry.waits_for = leader.seq.seq_id
        else:
            try:
                group.scheduler.check_new(seq)
            except ValueError as e:      # longer than this group's context limit
                return AddResult(AddCode.INVALID_ARGUMENT, str(e))
            if seq.sampling.constraint is not None:
                entry.preparing = True   # queued once the worker has compiled its grammar
                asyncio.ensure_future(self._prepare_then_queue(entry))
            else:
                group.scheduler.add(seq)
                group.wake()
        self._active[seq.seq_id] = entry
        self._by_request_id.setdefault(seq.request_id, []).append(seq.seq_id)
        return ADDED

    def _computing_prompt_of(self, request: CoreRequest, samples) -> _Active | None:
        """Sample 0 of the request, when `request` is a later sample of it (same frontend, same
        prompt) and sample 0 has no token yet: its prompt is still being computed."""
        if request.sample_index == 0:
            return None
        for seq_id in samples:
            entry = self._active[seq_id]
            if (entry.sample_index == 0 and frontend_of(seq_id) == frontend_of(request.seq_id)
                    and not entry.seq.num_output_tokens and entry.seq.token_ids == request.prompt_token_ids):
                return entry
        return None

    async def _prepare_then_queue(self, entry: _Active) -> None:
        """Queues a constrained request once its group's worker has compiled its grammar (off
        every step), or fails it naming why the grammar cannot be had."""
        seq = entry.seq
        error = await entry.group.prepare_grammar(seq.sampling.constraint)
        if self._active.get(seq.seq_id) is not entry:
            return                       # ended (aborted) meanwhile
        entry.preparing = False
        if error is None:
            try:
                entry.group.scheduler.add(seq)
                entry.group.wake()
                return
            except ValueError as e:      # the group's context limit changed meanwhile
                error = RequestError("INVALID_ARGUMENT", str(e))
        self._end(seq.seq_id, FinishReason.ABORT, notify=True, error=error)

    def _release_deferred(self, entry: _Active) -> None:
        """The samples that waited for entry's prompt join its group's queue."""
        group = entry.group
        for seq in entry.deferred:
            sample = self._active[seq.seq_id]
            sample.waits_for = None
            sample.group = group
            try:
                group.scheduler.add(seq)
            except ValueError as e:      # the group changed its context limit meanwhile
                logger.warning("sample %d could not follow sample 0: %s", sample.sample_index, e,
                               extra={"request_id": seq.request_id})
                self._end(seq.seq_id, FinishReason.ABORT, notify=True)
        entry.deferred = []
        group.wake()

    def abort(self, seq_ids: list[int], reason: FinishReason = FinishReason.ABORT, notify: bool = False) -> None:
        """Ends a frontend's own requests; with notify, each ending comes back as an event."""
        for seq_id in seq_ids:
            if seq_id in self._active:
                self._end(seq_id, reason, notify=notify)

    def abort_request_id(self, request_id: str) -> bool:
        """Ends a request (every sample of it) by its public id, from whichever frontend; its own
        frontend hears of it."""
        seq_ids = self._by_request_id.get(request_id)
        if not seq_ids:
            return False
        for seq_id in reversed(list(seq_ids)):   # later samples first: none is released for nothing
            if seq_id in self._active:
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
                num_paused=s.num_paused if s else 0, kv_cache_dtype=info.kv_cache_dtype if info else "",
                **_speculation_state(s.config.speculation if s else None),
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
            logger.warning("group %d is down: %d requests moved to healthy groups", down.index, len(moved))

    def _on_failed(self, group: GroupRunner, seq: Sequence, error: RequestError) -> None:
        if seq.seq_id in self._active:
            logger.error("failed alone: %s", error.message, extra={"request_id": seq.request_id})
            self._end(seq.seq_id, FinishReason.ABORT, notify=True, error=error)

    def _on_step(self, group: GroupRunner, output: SchedulerOutput, received: list[Sequence],
                 result: StepResult) -> None:
        """Packs what a step brought (prompt tokens scored, sampled tokens, endings) into one
        StepOutputs per frontend."""
        if not received and result.prompt_logprobs is None and not result.failed:
            return
        counts = output.received_counts
        self.metrics.observe_sampled(sum(counts) if counts is not None else len(received))
        now = time.monotonic()
        per_frontend: dict[int, StepOutputs] = {}
        # Where each sampling sequence's tokens start in the reply's columns, when any asked logprobs.
        first_of = _first_token_index(output, result) if result.logprobs is not None else None
        logprobs = result.logprobs
        tops = result.top_logprobs.entries() if first_of is not None and result.top_logprobs is not None else None

        def new_outputs() -> StepOutputs:
            return StepOutputs(logprobs=[] if first_of is not None else None,
                               top_logprobs=TopLogprobColumns() if tops is not None else None)

        active = self._active
        failed = result.failed
        for seq_id, error in failed.items():     # their tokens are void
            if seq_id in active:
                logger.warning("failed by the worker: %s: %s", error.code, error.message,
                            extra={"request_id": active[seq_id].seq.request_id})
                self._end(seq_id, FinishReason.ABORT, notify=True, error=error)
        if result.prompt_logprobs is not None:
            self._add_prompt_logprobs(result.prompt_logprobs, per_frontend, new_outputs)
        for i, seq in enumerate(received):
            seq_id = seq.seq_id
            entry = active.get(seq_id)
            if entry is None:
                continue
            outputs = per_frontend.get(frontend_of(seq_id))
            if outputs is None:
                outputs = per_frontend[frontend_of(seq_id)] = new_outputs()
            n = counts[i] if counts is not None else 1
            outputs.seq_ids += [seq_id] * n
            outputs.token_ids += seq.token_ids[-n:]
            if first_of is not None:
                first = first_of[seq_id]
                outputs.logprobs += logprobs[first:first + n]
                if tops is not None:
                    for top in tops[first:first + n]:
                        outputs.top_logprobs.append(*top)
            if entry.first_token_at is None:
                entry.first_token_at = now
                if entry.deferred:       # its prompt's blocks are cached now
                    self._release_deferred(entry)
            if seq.finish_reason is not None:
                outputs.finished.append(self._forget(seq_id))
        for frontend_id, outputs in per_frontend.items():
            queue = self._subscribers.get(frontend_id)
            if queue is not None:
                queue.put_nowait(CoreEvent(outputs=outputs))

    def _add_prompt_logprobs(self, scored: StepPromptLogprobs, per_frontend: dict[int, StepOutputs],
                             new_outputs) -> None:
        """Forwards the prompt logprobs a step computed, each token once: a prompt recomputed
        after a preemption is scored again from its start, and what was sent is skipped."""
        tops = scored.top.entries() if scored.top is not None else None
        offset = 0
        for seq_id, first, count in zip(scored.seq_ids, scored.first_positions, scored.counts):
            start, offset = offset, offset + count
            entry = self._active.get(seq_id)
            if entry is None:
                continue
            skip = entry.prompt_scored + 1 - first      # position 0 is never scored
            if skip < 0:
                logger.error("prompt logprobs from position %d, but %d were sent: dropped", first,
                             entry.prompt_scored, extra={"request_id": entry.seq.request_id})
                continue
            if skip >= count:
                continue
            outputs = per_frontend.get(frontend_of(seq_id))
            if outputs is None:
                outputs = per_frontend[frontend_of(seq_id)] = new_outputs()
            if outputs.prompt_logprobs is None:
                outputs.prompt_logprobs = PromptLogprobs(top=TopLogprobColumns() if tops is not None else None)
            prompt = outputs.prompt_logprobs
            prompt.seq_ids.append(seq_id)
            prompt.counts.append(count - skip)
            prompt.logprobs += scored.logprobs[start + skip:offset]
            if tops is not None:
                for token_ids, logprobs in tops[start + skip:offset]:
                    prompt.top.append(token_ids, logprobs)
            entry.prompt_scored += count - skip

    # -- endings ----------------------------------------------------------------------------
    def _end(self, seq_id: int, reason: FinishReason, *, notify: bool, error: RequestError | None = None) -> None:
        """Ends a request the scheduler still runs, or one deferred or preparing (abort, stop
        string, shutdown, failure: with `error`, which its samples waiting for it share)."""
        entry = self._active[seq_id]
        if error is not None:
            for sample in list(entry.deferred):
                self._end(sample.seq_id, reason, notify=notify, error=error)
        if entry.waits_for is None:
            entry.group.scheduler.finish(seq_id, reason)
        else:
            entry.seq.finish_reason = reason
        entry.group.wake()
        finished = self._forget(seq_id)
        finished.error = error
        if notify:
            queue = self._subscribers.get(frontend_of(seq_id))
            if queue is not None:
                queue.put_nowait(CoreEvent(outputs=StepOutputs(finished=[finished])))

    def _forget(self, seq_id: int) -> FinishedRequest:
        entry = self._active.pop(seq_id)
        seq = entry.seq
        samples = self._by_request_id.get(seq.request_id)
        if samples is not None:
            samples.remove(seq_id)
            if not samples:
                del self._by_request_id[seq.request_id]
        if entry.waits_for is not None:          # never ran: its leader stops waiting for it
            leader = self._active.get(entry.waits_for)
            if leader is not None:
                leader.deferred.remove(seq)
        if entry.deferred:                       # ended before its prompt was computed
            self._release_deferred(entry)
        reason = seq.finish_reason or FinishReason.ABORT
        self.metrics.observe_request(reason.value, seq.arrival_time, entry.first_token_at,
                                     seq.num_prompt_tokens, seq.num_output_tokens)
        # Logged from the step loop, which serves many requests: name this one explicitly.
        logger.info("finished (%s): %d prompt tokens (%d cached), %d generated", reason.value, seq.num_prompt_tokens,
                    seq.num_cached_prompt_tokens, seq.num_output_tokens, extra={"request_id": seq.request_id})
        return FinishedRequest(seq_id, reason, seq.num_output_tokens, seq.num_cached_prompt_tokens)


def _first_token_index(output: SchedulerOutput, result: StepResult) -> dict[int, int]:
    """seq_id -> the index of its first token in the reply's token columns."""
    seq_ids = [s.seq_id for s in output.sampling_seqs]
    if not result.token_counts:
        return {seq_id: i for i, seq_id in enumerate(seq_ids)}
    firsts, offset = {}, 0
    for seq_id, count in zip(seq_ids, result.token_counts):
        firsts[seq_id] = offset
        offset += count
    return firsts


def _speculation_state(config: SpeculationConfig | None) -> dict:
    """GroupState's speculative-decoding fields: the method and drafts per step, when on."""
    if config is None or not config.num_speculative_tokens:
        return {}
    return dict(speculative_method=config.method, num_speculative_tokens=config.num_speculative_tokens)
