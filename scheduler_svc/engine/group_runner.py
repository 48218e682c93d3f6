"""One worker group's step loop: its scheduler (and block manager), the connection to its ranks,
and the asyncio task that schedules, sends each step message and applies the sampled tokens.

With async scheduling, step N+1 is scheduled and sent as soon as step N is: the worker finds it
queued when it finishes N (and prepares it while N still runs on the device), so neither the round
trip nor the scheduler's Python sits between two steps on the device. Results are applied in step
order. What a step produced goes to the owner through `on_step`; a failed step or a dead worker
takes the group down (`on_down`), and the loop reconnects, resets the worker and starts over from
the scheduler's tokens (the source of truth).

A group's workers belong to this scheduler alone while it holds their lease (worker_svc/lease.py):
connecting claims them under the scheduler's identity and a fresh epoch, every step and reset
carries that epoch (which renews the lease), and an idle group renews it with each liveness
probe. A worker leased to another scheduler keeps the group waiting until that lease lapses.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from common.constraint import Constraint
from common.features import Feature
from scheduler_svc.engine.api import RequestError
from scheduler_svc.engine.block_manager import BlockManager
from scheduler_svc.engine.config import EngineConfig, steps_in_flight
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.scheduler_output import SchedulerOutput
from scheduler_svc.engine.sequence import Sequence
from scheduler_svc.engine.speculation import SpeculationConfig
from scheduler_svc.engine.step_log import StepLog
from scheduler_svc.engine.step_message import StepResult, build_step_request, parse_step_response
from scheduler_svc.engine.worker_client import WorkerError, WorkerGroupClient

logger = logging.getLogger(__name__)

LOOP_RESTART_MAX_S = 30.0   # the longest wait before restarting a step loop that keeps failing


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether `event` was set within timeout_s. Unlike asyncio.wait_for on Python 3.11, a
    cancellation that coincides with the event is never swallowed (group.stop() relies on it)."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return bool(done)


class StepLimitError(WorkerError):
    """The scheduler is configured for larger steps than a group's workers take."""


def new_lease_epoch() -> int:
    """A fresh epoch for a claim: nanoseconds since 1970, so a restarted scheduler's epoch differs
    from (and follows) its previous life's."""
    return time.time_ns()


@dataclass
class GroupHooks:
    """What a group tells its owner."""
    on_connected: Callable[["GroupRunner"], None]
    on_step: Callable[["GroupRunner", SchedulerOutput, list[Sequence], StepResult], None]
    on_down: Callable[["GroupRunner"], None]
    on_waiting: Callable[["GroupRunner"], None] = lambda group: None   # down_reason changed
    # A request failed for good (it made the worker fail --max-request-failures times).
    on_failed: Callable[["GroupRunner", Sequence, RequestError], None] = lambda group, seq, error: None


class GroupRunner:
    def __init__(self, index: int, client: WorkerGroupClient, config: EngineConfig, eos_token_ids: list[int],
                 metrics: SchedulerMetrics, hooks: GroupHooks, step_log: StepLog | None = None) -> None:
        self.index = index
        self.client = client
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.metrics = metrics
        self.hooks = hooks
        self.step_log = step_log                   # --step-log: a line per applied step
        self.scheduler: Scheduler | None = None    # once the group first connected
        self.healthy = False
        self.info = None                           # rank 0's WorkerInfo
        self._instance_ids: list[str] = []
        self._lease_epoch = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._step_ids = itertools.count(1)
        self.last_step_ms = 0.0
        self._last_reply_at = 0.0
        self._down_reason: str | None = "not connected yet"
        # The requests the worker was computing when the group went down: its restart loses
        # their KV and mirrors, so they are the ones re-sent in full.
        self._lost_seq_ids: set[int] = set()
        self._prepare_slots = asyncio.Semaphore(config.grammar_prepare_concurrency)
        self._loop_failures = 0            # step loops that raised since a step was last applied
        self._restart: asyncio.TimerHandle | None = None
        self._stopped = False

    # -- connection -----------------------------------------------------------------------
    async def connect(self) -> None:
        """Describes every rank, checks they agree and take the configured limits, claims them,
        and (re)builds state after a restart."""
        infos = await self.client.describe(timeout=10.0)
        first = infos[0]
        for info in infos[1:]:
            if (info.num_kv_blocks, info.block_size) != (first.num_kv_blocks, first.block_size):
                raise WorkerError(f"ranks of group {self.index} disagree on KV cache shape")
        limits = self.scheduler_config(infos)
        # A fresh epoch: whatever an earlier life of this scheduler still sends is refused.
        epoch = new_lease_epoch()
        instance_ids = await self.client.claim(self.config.instance_id, epoch, self.config.worker_lease_s,
                                               timeout=10.0)
        if self.scheduler is None:
            self.scheduler = Scheduler(limits, BlockManager(first.num_kv_blocks, first.block_size),
                                       eos_token_ids=self.eos_token_ids)
        elif instance_ids != self._instance_ids:
            self._log_restart()
        self._lost_seq_ids = set()
        # Whatever the worker holds now is not what our block tables describe: start both clean.
        self.scheduler.reset_all_worker_state()
        await self.client.reset(epoch, timeout=10.0)
        # A reset worker expects step 1 next (it runs steps in step_id order).
        self._step_ids = itertools.count(1)
        self._lease_epoch = epoch
        self._instance_ids = instance_ids
        self.info = first
        self.healthy = True
        self._down_reason = None
        held = f"{limits.max_held_requests} held at once" if limits.max_held_requests else "no bound said on those held"
        logger.info("group %d connected: %s, %d KV blocks of %d tokens, %s, steps of up to %d tokens and %d requests"
                    " (%s)", self.index, ",".join(self.client.addresses), first.num_kv_blocks, first.block_size,
                    first.device, limits.max_num_batched_tokens, limits.max_num_seqs, held)
        self.hooks.on_connected(self)

    async def _reconnect(self) -> None:
        """Retries until the group answers, logging each change of why it does not (not each try)."""
        while True:
            try:
                await self.connect()
                return
            except WorkerError as e:
                if str(e) != self._down_reason:
                    level = logging.ERROR if isinstance(e, StepLimitError) else logging.INFO
                    logger.log(level, "group %d: waiting for its workers: %s", self.index, e)
                    self._down_reason = str(e)
                    self.hooks.on_waiting(self)
                await asyncio.sleep(self.config.reconnect_interval_s)

    def scheduler_config(self, infos: list) -> SchedulerConfig:
        """The engine's limits for this group (every rank's WorkerInfo)."""
        return SchedulerConfig(
            max_num_seqs=self._step_limit("max_num_seqs", infos),
            max_num_batched_tokens=self._step_limit("max_num_batched_tokens", infos),
            max_model_len=self.max_model_len_for(infos[0]),
            block_size=infos[0].block_size,
            priority_aging_s=self.config.priority_aging_s,
            speculation=self._speculation(infos),
            max_held_requests=_least_reported("max_held_requests", infos),
        )

    def _speculation(self, infos: list) -> SpeculationConfig:
        """Speculative decoding as configured, within what the workers propose: unset follows them,
        `off` turns it off, and a method or more drafts than they serve is refused."""
        where = f"the workers of group {self.index} ({','.join(self.client.addresses)})"
        served = {(info.speculative_method, info.num_speculative_tokens) for info in infos}
        if len(served) > 1:
            raise StepLimitError(f"{where} disagree on speculative decoding: {sorted(served)}")
        ((method, most),) = served
        wanted, k = self.config.speculative_method, self.config.num_speculative_tokens
        if wanted == "off" or (not method and wanted is None):
            return SpeculationConfig(0, self.config.speculative_max_batch_size)
        if wanted is not None and wanted != method:
            raise StepLimitError(f"--speculative-method {wanted}, but {where} propose "
                                 f"{'with ' + method if method else 'no drafts'}: start them with "
                                 f"--speculative-method {wanted} (or leave it unset here to follow them)")
        if k is not None and k > most:
            raise StepLimitError(f"--num-speculative-tokens {k} is more than the {most} drafts {where} propose: "
                                 "lower it or leave it unset to follow them")
        return SpeculationConfig(most if k is None else k, self.config.speculative_max_batch_size, method)

    def _step_limit(self, name: str, infos: list) -> int:
        """The configured limit, or when unset the least any rank takes in one step. A worker
        refuses a step past its own limit, so a configured one above it is refused here."""
        flag = "--" + name.replace("_", "-")
        capacity = _least_reported(name, infos)
        configured = getattr(self.config, name)
        if configured is None:
            if not capacity:
                raise StepLimitError(f"{flag} is unset and the workers of group {self.index} "
                                     f"({','.join(self.client.addresses)}) do not report {name}: set {flag}")
            return capacity
        if capacity and configured > capacity:
            raise StepLimitError(f"{flag} {configured} is more than the {capacity} the workers of group {self.index} "
                                 f"({','.join(self.client.addresses)}) take in one step (their {flag}): lower it "
                                 "or leave it unset to follow the workers")
        return configured

    def max_model_len_for(self, info) -> int:
        """The context limit of the group: the configured one, what the model supports, and what
        its KV cache holds (so a single request can always run to the limit alone)."""
        limits = [info.max_model_len, info.num_kv_blocks * info.block_size]
        if self.config.max_model_len:
            limits.append(self.config.max_model_len)
        return min(limits)

    @property
    def down_reason(self) -> str | None:
        """Why the group is not serving (None while it is)."""
        return self._down_reason

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len if self.scheduler else 0

    @property
    def features(self) -> tuple[Feature, ...]:
        """What the group's rank 0 said it can serve of the optional features (none known yet: ())."""
        if self.info is None:
            return ()
        return tuple(Feature(f.name, f.available, f.detail) for f in self.info.features)

    async def prepare_grammar(self, constraint: Constraint) -> RequestError | None:
        """Has rank 0 compile a request's constraint before the request is queued, so no step
        waits for it. Returns why the request must fail (the constraint does not compile, or not
        within the worker's budget; no structured output there), or None to queue it, also when
        the group could not be asked (down, or restarted: a step then compiles it)."""
        async with self._prepare_slots:
            if not self.healthy:
                return None
            try:
                await self.client.prepare_grammar(constraint, self._lease_epoch, timeout=self.config.step_timeout_s)
            except WorkerError as e:
                if e.code in ("INVALID_ARGUMENT", "UNIMPLEMENTED"):
                    return RequestError(e.code, e.details, about_constraint=e.code == "INVALID_ARGUMENT")
                logger.warning("group %d could not prepare a %s grammar (%s); its first step compiles it",
                               self.index, constraint.kind, e)
        return None

    # -- step loop ------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"group-{self.index}")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A step loop that raised (a bug: worker failures are handled inside it) is logged with
        its traceback and started again, as after a worker failure: the group goes down, its
        requests move to healthy groups or wait, and the new loop reconnects (resetting the
        workers) and re-sends them. Without this the group would stop scheduling in silence.
        Failures in a row (no step applied between them) wait longer each time, up to
        LOOP_RESTART_MAX_S, so a failure that repeats does not spin."""
        if task.cancelled() or task.exception() is None or self._stopped:
            return
        self._loop_failures += 1
        delay = min(self.config.reconnect_interval_s * 2 ** (self._loop_failures - 1), LOOP_RESTART_MAX_S)
        logger.error("group %d: its step loop failed (%d in a row); restarting it in %.3g s", self.index,
                     self._loop_failures, delay, exc_info=task.exception())
        if self.scheduler is not None and self.healthy:
            self._mark_down(f"the step loop failed: {task.exception()!r}")
        self.healthy = False
        self._restart = asyncio.get_running_loop().call_later(delay, self.start)

    async def stop(self) -> None:
        self._stopped = True
        if self._restart is not None:
            self._restart.cancel()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        self._wakeup.set()

    async def _loop(self) -> None:
        # Steps sent whose replies are not applied yet, oldest first: with async scheduling one
        # more is scheduled and sent as soon as the last one is, so the worker (which runs steps
        # in step_id order) finds it queued when it finishes the current one; two more while the
        # batch is small, three at the smallest (EngineConfig.third_step_max_seqs, fourth_step_max_seqs).
        in_flight: deque[tuple[SchedulerOutput, asyncio.Task, float]] = deque()
        try:
            while True:
                if not self.healthy:
                    await self._reconnect()
                if len(in_flight) < self._depth() and self.scheduler.has_unfinished():
                    output = self.scheduler.schedule()
                    if not output.is_empty:
                        in_flight.append(self._send(output))
                        continue
                if not in_flight:
                    # Nothing to do, or nothing fits right now (every request waits for blocks
                    # held by none): wait for an abort or a new request instead of spinning,
                    # probing the worker meanwhile so a death is seen before the next request.
                    self._wakeup.clear()
                    if not await wait_event(self._wakeup, self.config.idle_probe_interval_s):
                        await self._probe()
                    continue
                output, reply, sent_at = in_flight.popleft()
                try:
                    self._apply(output, await reply, sent_at, len(in_flight))
                except WorkerError as e:
                    # Let the steps sent after it settle first, so none still runs on the
                    # worker when the reconnect resets it; their results are void.
                    await asyncio.gather(*(r for _, r, _ in in_flight), return_exceptions=True)
                    in_flight.clear()
                    blamed = self._blame(output)
                    self._mark_down(f"step failed ({e})")
                    for seq in blamed:
                        self.hooks.on_failed(self, seq, RequestError(
                            "INTERNAL", f"the worker failed {seq.num_failures} times while computing this request "
                                        f"(last: {e.details or e}); it is not sent again"))
        finally:
            for _, reply, _ in in_flight:
                reply.cancel()

    def _depth(self) -> int:
        """How many steps may be in flight now: 1 without async scheduling, 4 while the fewest requests
        run or wait, 3 while few do (without speculative decoding), else 2."""
        if not self.config.async_scheduling:
            return 1
        scheduler = self.scheduler
        if scheduler.config.speculation.num_speculative_tokens:
            return 2
        return steps_in_flight(len(scheduler.running) + len(scheduler.waiting), self.config.third_step_max_seqs,
                               self.config.fourth_step_max_seqs)

    def _log_restart(self) -> None:
        """Says what a worker restart costs: the requests it was computing (those still queued
        here; a healthy group may have taken the others) are re-sent in full and recomputed."""
        waiting = self.scheduler.waiting
        resent = sum(1 for seq in waiting if seq.seq_id in self._lost_seq_ids)
        logger.warning("group %d: worker restarted; re-sending in full the %d requests it was computing "
                       "(%d more waiting were not on it yet)", self.index, resent, len(waiting) - resent)

    def _blame(self, failed: SchedulerOutput) -> list[Sequence]:
        """Counts a failed step against its suspects (requests of an earlier failed step, which
        come back one at a time: see scheduler.py) and makes its other requests suspects.
        Returns the requests that have now failed max_request_failures times."""
        blamed = []
        for seq in failed.seqs:
            if seq.is_finished:
                continue
            if seq.suspect:
                seq.num_failures += 1
                if seq.num_failures >= self.config.max_request_failures:
                    blamed.append(seq)
            seq.suspect = True
        return blamed

    def _mark_down(self, why: str) -> None:
        logger.error("group %d: %s; marking it down", self.index, why)
        self._lost_seq_ids = {seq.seq_id for seq in self.scheduler.running}
        self.healthy = False
        self._down_reason = why
        self.metrics.observe_worker_failure(self.index)
        self.scheduler.reset_all_worker_state()
        self.hooks.on_down(self)

    async def _probe(self) -> None:
        """An idle group's liveness check, which renews its lease: a rank that does not answer,
        refuses (another scheduler took it over), or answers as a new process (it restarted
        between steps, its state gone) takes the group down; the reconnect then rebuilds it."""
        try:
            instance_ids = await self.client.claim(self.config.instance_id, self._lease_epoch,
                                                   self.config.worker_lease_s, timeout=self.config.idle_probe_timeout_s)
        except WorkerError as e:
            self._mark_down(f"idle probe failed ({e})")
            return
        if instance_ids != self._instance_ids:
            self._mark_down("a worker restarted while idle")

    def _send(self, output: SchedulerOutput) -> tuple[SchedulerOutput, asyncio.Task, float]:
        request = build_step_request(next(self._step_ids), output)
        request.lease_epoch = self._lease_epoch
        reply = asyncio.ensure_future(self.client.step(request, timeout=self.config.step_timeout_s))
        return output, reply, time.perf_counter()

    def _apply(self, output: SchedulerOutput, reply, sent_at: float, behind: int) -> None:
        """Applies a step's reply and hands what it produced to the owner (`behind`: the steps
        still in flight after it, for the step log)."""
        now = time.perf_counter()
        self._loop_failures = 0
        # A pipelined step queues behind the one before it: time it from when that one replied.
        self.last_step_ms = (now - max(sent_at, self._last_reply_at)) * 1000
        self._last_reply_at = now
        result = parse_step_response(reply)
        self.metrics.observe_step(output.num_scheduled_tokens, self.last_step_ms,
                                 result.device_ms or result.forward_ms)
        if self.step_log is not None:
            self.step_log.record(self.index, now, self.last_step_ms, result.device_ms, result.forward_ms, output, behind)
        try:
            received = self.scheduler.update(output, result.token_ids, result.token_counts, result.num_drafts,
                                             result.verified_drafts)
        except ValueError as e:       # the reply lacks tokens the step had to sample
            raise WorkerError(f"group {self.index}: {e}") from e
        for seq in output.seqs:       # a step that went through clears its requests of suspicion
            seq.suspect = False
        if output.num_verifications:
            self.metrics.observe_spec_decode(output.num_verifications, output.num_draft_tokens,
                                             output.num_accepted_tokens)
        self.hooks.on_step(self, output, received, result)

    # -- load -----------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting if self.scheduler else 0


def _least_reported(name: str, infos: list) -> int:
    """The least value of WorkerInfo field `name` that any rank reports; 0 when none says one."""
    return min((getattr(info, name) for info in infos if getattr(info, name)), default=0)
