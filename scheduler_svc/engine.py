"""The engine: admits requests, routes each to a worker group, and runs one asyncio step loop per
group that schedules, sends the step message, applies the sampled tokens and streams the results.

Everything runs on one event loop, so request state needs no locks; per-step Python work is
proportional to the batch (the step message carries diffs, tokens are detokenized incrementally).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from common.pb.llm.v1 import generation_pb2
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from scheduler_svc.sequence import FinishReason, Sequence
from scheduler_svc.step_message import build_step_request
from scheduler_svc.stop_strings import StopStringMatcher
from scheduler_svc.worker_client import WorkerError, WorkerGroupClient

log = logging.getLogger("scheduler.engine")

_FINISH_TO_PROTO = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
}


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None      # None: what the workers support
    max_waiting: int = 4096               # admission bound: past it, requests are refused
    step_timeout_s: float = 300.0         # a step slower than this counts as a dead worker
    reconnect_interval_s: float = 0.5
    idle_probe_interval_s: float = 1.0    # how often an idle group checks its workers are alive
    idle_probe_timeout_s: float = 2.0
    startup_timeout_s: float = 300.0
    # Schedule and send step N+1 while the worker runs step N, so it never waits for the
    # round trip and the scheduler's per-step work (vLLM's async scheduling). Needs workers
    # that run steps in the order sent, as the gRPC worker and LocalWorkerClient do.
    async_scheduling: bool = True


@dataclass
class RequestOutput:
    """One streamed message: tokens and text new since the last one."""
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: int = generation_pb2.FINISH_REASON_UNSPECIFIED
    usage: generation_pb2.Usage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED


class EngineFull(Exception):
    """The waiting queue is at its bound."""


class DuplicateRequest(Exception):
    """A request with this id is already active."""


class EngineUnavailable(Exception):
    """No worker group can take requests (shutting down, or none connected yet)."""


@dataclass
class _Active:
    seq: Sequence
    group: "GroupRunner"
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None


class GroupRunner:
    """One worker group: its scheduler (and block manager) and the loop that steps it."""

    def __init__(self, index: int, client: WorkerGroupClient, engine: "Engine") -> None:
        self.index = index
        self.client = client
        self.engine = engine
        self.scheduler: Scheduler | None = None
        self.healthy = False
        self.info = None               # rank 0's WorkerInfo
        self._instance_ids: list[str] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._step_ids = itertools.count(1)
        self.last_step_ms = 0.0
        self._last_reply_at = 0.0

    # -- connection -----------------------------------------------------------------------
    async def connect(self) -> None:
        """Describes every rank, checks they agree, and (re)builds state after a restart."""
        infos = await self.client.describe(timeout=10.0)
        first = infos[0]
        for info in infos[1:]:
            if (info.num_kv_blocks, info.block_size) != (first.num_kv_blocks, first.block_size):
                raise WorkerError(f"ranks of group {self.index} disagree on KV cache shape")
        instance_ids = [i.instance_id for i in infos]
        if self.scheduler is None:
            self.scheduler = Scheduler(
                self.engine.scheduler_config(first),
                BlockManager(first.num_kv_blocks, first.block_size),
                eos_token_ids=self.engine.eos_token_ids,
            )
        elif instance_ids != self._instance_ids:
            log.warning("group %d: worker restarted; re-sending %d running requests in full",
                        self.index, self.scheduler.num_running)
        # Whatever the worker holds now is not what our block tables describe: start both clean.
        self.scheduler.reset_all_worker_state()
        await self.client.reset(timeout=10.0)
        # A reset worker expects step 1 next (it runs steps in step_id order).
        self._step_ids = itertools.count(1)
        self._instance_ids = instance_ids
        self.info = first
        self.healthy = True
        log.info("group %d connected: %s, %d KV blocks of %d tokens, %s", self.index,
                 ",".join(self.client.addresses), first.num_kv_blocks, first.block_size, first.device)

    async def _reconnect(self) -> None:
        while True:
            try:
                await self.connect()
                return
            except WorkerError as e:
                log.debug("group %d still down: %s", self.index, e)
                await asyncio.sleep(self.engine.config.reconnect_interval_s)

    # -- step loop ------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"group-{self.index}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        self._wakeup.set()

    async def _loop(self) -> None:
        # Steps sent whose replies are not applied yet, oldest first: with async scheduling one
        # more is scheduled and sent as soon as the last one is, so the worker (which runs steps
        # in step_id order) finds it queued when it finishes the current one.
        depth = 2 if self.engine.config.async_scheduling else 1
        in_flight: deque[tuple[SchedulerOutput, asyncio.Task, float]] = deque()
        try:
            while True:
                if not self.healthy:
                    await self._reconnect()
                if len(in_flight) < depth and self.scheduler.has_unfinished():
                    output = self.scheduler.schedule()
                    if not output.is_empty:
                        in_flight.append(self._send(output))
                        continue
                if not in_flight:
                    # Nothing to do, or nothing fits right now (every request waits for blocks
                    # held by none): wait for an abort or a new request instead of spinning,
                    # probing the worker meanwhile so a death is seen before the next request.
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), self.engine.config.idle_probe_interval_s)
                    except asyncio.TimeoutError:
                        await self._probe()
                    continue
                output, reply, sent_at = in_flight.popleft()
                try:
                    self._apply(output, await reply, sent_at)
                except WorkerError as e:
                    # Let the steps sent after it settle first, so none still runs on the
                    # worker when the reconnect resets it; their results are void.
                    await asyncio.gather(*(r for _, r, _ in in_flight), return_exceptions=True)
                    in_flight.clear()
                    self._mark_down(f"step failed ({e})")
        finally:
            for _, reply, _ in in_flight:
                reply.cancel()

    def _mark_down(self, why: str) -> None:
        log.error("group %d: %s; marking it down", self.index, why)
        self.healthy = False
        self.engine.metrics.observe_worker_failure(self.index)
        self.scheduler.reset_all_worker_state()
        self.engine.migrate_from(self)

    async def _probe(self) -> None:
        """An idle group's liveness check: a rank that does not answer, or answers as a new
        process (it restarted between steps, its mirrors gone), takes the group down; the
        reconnect then rebuilds it."""
        try:
            infos = await self.client.describe(timeout=self.engine.config.idle_probe_timeout_s)
        except WorkerError as e:
            self._mark_down(f"idle probe failed ({e})")
            return
        if [i.instance_id for i in infos] != self._instance_ids:
            self._mark_down("a worker restarted while idle")

    def _send(self, output: SchedulerOutput) -> tuple[SchedulerOutput, asyncio.Task, float]:
        request = build_step_request(next(self._step_ids), output)
        reply = asyncio.create_task(self.client.step(request, timeout=self.engine.config.step_timeout_s))
        return output, reply, time.perf_counter()

    def _apply(self, output: SchedulerOutput, reply, sent_at: float) -> None:
        """Applies a step's reply and streams the tokens it brought."""
        now = time.perf_counter()
        # A pipelined step queues behind the one before it: time it from when that one replied.
        self.last_step_ms = (now - max(sent_at, self._last_reply_at)) * 1000
        self._last_reply_at = now
        self.engine.metrics.observe_step(output.num_scheduled_tokens, self.last_step_ms, reply.timings.forward_ms)
        sampled = {t.seq_id: t for t in reply.sampled}
        try:
            received = self.scheduler.update(output, {i: t.token_id for i, t in sampled.items()})
        except ValueError as e:       # the reply lacks tokens the step had to sample
            raise WorkerError(f"group {self.index}: {e}") from e
        for seq in received:
            self.engine._emit(seq, sampled[seq.seq_id].logprob)

    # -- load -----------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting if self.scheduler else 0


class Engine:
    def __init__(self, groups: list[WorkerGroupClient], *, tokenizer, eos_token_ids: list[int],
                 vocab_size: int, config: EngineConfig | None = None, metrics: SchedulerMetrics | None = None) -> None:
        if not groups:
            raise ValueError("the engine needs at least one worker group")
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.metrics = metrics or SchedulerMetrics()
        self.groups = [GroupRunner(i, g, self) for i, g in enumerate(groups)]
        self._active: dict[str, _Active] = {}
        self._by_seq: dict[int, _Active] = {}
        self._seq_ids = itertools.count(1)
        self._accepting = False
        self._draining = False

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Connects every group (waiting for workers that are still starting), then steps."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        for group in self.groups:
            while True:
                try:
                    await group.connect()
                    break
                except WorkerError as e:
                    if time.monotonic() > deadline:
                        raise
                    log.info("waiting for group %d: %s", group.index, e)
                    await asyncio.sleep(self.config.reconnect_interval_s)
        for group in self.groups:
            group.start()
        self._accepting = True

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stops admitting, lets running requests finish for grace_s, then aborts the rest."""
        self._accepting = False
        self._draining = True
        deadline = time.monotonic() + grace_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._active):
            self.abort(request_id)
        for group in self.groups:
            await group.stop()
            await group.client.close()

    def scheduler_config(self, info) -> SchedulerConfig:
        """This engine's limits, capped by what the group's workers accept in one step (0: a
        worker that does not say)."""
        return SchedulerConfig(
            max_num_seqs=min(self.config.max_num_seqs, info.max_num_seqs or self.config.max_num_seqs),
            max_num_batched_tokens=min(self.config.max_num_batched_tokens,
                                       info.max_num_batched_tokens or self.config.max_num_batched_tokens),
            max_model_len=self.max_model_len_for(info),
            block_size=info.block_size,
        )

    def max_model_len_for(self, info) -> int:
        """The context limit of a group: the configured one, what the model supports, and what
        its KV cache holds (so a single request can always run to the limit alone)."""
        limits = [info.max_model_len, info.num_kv_blocks * info.block_size]
        if self.config.max_model_len:
            limits.append(self.config.max_model_len)
        return min(limits)

    @property
    def max_model_len(self) -> int:
        return min(self.max_model_len_for(g.info) for g in self.groups if g.info)

    @property
    def accepting(self) -> bool:
        return self._accepting and any(g.healthy for g in self.groups)

    # -- requests -------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return sum(g.scheduler.num_waiting for g in self.groups if g.scheduler)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queues a validated request; returns its stream of outputs."""
        if not self._accepting:
            raise EngineUnavailable("the server is shutting down" if self._draining
                                    else "the server is still connecting to its workers")
        if request_id in self._active:
            raise DuplicateRequest(f"request_id {request_id!r} is already in flight")
        if self.num_waiting() >= self.config.max_waiting:
            raise EngineFull(f"{self.config.max_waiting} requests are already waiting; retry later")
        group = self._route(prompt_token_ids)
        seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params)
        active = _Active(
            seq=seq, group=group,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
            stops=StopStringMatcher(params.stop) if params.stop else None,
        )
        self._active[request_id] = active
        self._by_seq[seq.seq_id] = active
        group.scheduler.add(seq)
        group.wake()
        return self._stream(active)

    def migrate_from(self, down: GroupRunner) -> None:
        """Moves a down group's requests to the healthy groups (by the same routing as new
        requests), where they are recomputed from their tokens; with no healthy group they stay
        and wait for this one to come back."""
        if not any(g.healthy for g in self.groups):
            return
        moved = down.scheduler.hand_over()
        for seq in moved:
            active = self._by_seq[seq.seq_id]
            active.group = self._route(seq.token_ids)
            active.group.scheduler.adopt(seq)
            active.group.wake()
        if moved:
            log.warning("group %d is down: %d requests moved to healthy groups", down.index, len(moved))

    def _route(self, prompt_token_ids: list[int]) -> GroupRunner:
        """The healthy group holding the longest cached prefix of the prompt; ties go to the
        least loaded. With every group down, the least loaded one queues it until it is back."""
        candidates = [g for g in self.groups if g.healthy] or self.groups
        return max(candidates, key=lambda g: (g.scheduler.block_manager.cached_prefix_len(prompt_token_ids), -g.load))

    async def _stream(self, active: _Active) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await active.queue.get()
                yield out
                if out.finished:
                    return
        finally:
            # The consumer went away (cancelled stream, deadline): free the request at once.
            if active.seq.request_id in self._active:
                self.abort(active.seq.request_id)

    def abort(self, request_id: str) -> bool:
        active = self._active.get(request_id)
        if active is None:
            return False
        active.group.scheduler.abort(active.seq.seq_id)
        active.group.wake()
        self._finish(active, FinishReason.ABORT, [], "", [])
        return True

    # -- outputs --------------------------------------------------------------------------
    def _emit(self, seq: Sequence, logprob: float) -> None:
        """Turns the token a step appended to `seq` into a stream message."""
        active = self._by_seq.get(seq.seq_id)
        if active is None:
            return
        if active.first_token_at is None:
            active.first_token_at = time.monotonic()
        token = seq.last_token_id
        logprobs = [logprob] if seq.sampling.logprobs else []
        text = active.detokenizer.push([token])
        if seq.is_finished:
            text += active.detokenizer.flush()
        stopped = False
        if active.stops is not None:
            text, stopped = active.stops.feed(text)
            if seq.is_finished and not stopped:
                text += active.stops.flush()
        if stopped:
            if not seq.is_finished:
                active.group.scheduler.finish(seq.seq_id, FinishReason.STOP)
            self._finish(active, FinishReason.STOP, [token], text, logprobs)
        elif seq.is_finished:
            self._finish(active, seq.finish_reason, [token], text, logprobs)
        else:
            active.queue.put_nowait(RequestOutput([token], text, logprobs))

    def _finish(self, active: _Active, reason: FinishReason, tokens: list[int], text: str, logprobs: list[float]) -> None:
        seq = active.seq
        self._active.pop(seq.request_id, None)
        self._by_seq.pop(seq.seq_id, None)
        usage = generation_pb2.Usage(
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_prompt_tokens=seq.num_cached_prompt_tokens,
        )
        self.metrics.observe_request(reason.value, seq.arrival_time, active.first_token_at,
                                     seq.num_prompt_tokens, seq.num_output_tokens)
        # Logged from the step loop, which serves many requests: name this one explicitly.
        log.info("finished (%s): %d prompt tokens (%d cached), %d generated", reason.value, seq.num_prompt_tokens,
                 seq.num_cached_prompt_tokens, seq.num_output_tokens, extra={"request_id": seq.request_id})
        active.queue.put_nowait(RequestOutput(tokens, text, logprobs, _FINISH_TO_PROTO[reason], usage))
