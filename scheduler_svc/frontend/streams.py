"""A frontend: the request side of the scheduler service. It admits requests into the engine core,
turns the core's packed per-step outputs into each request's messages (detokenized, cut at stop
strings, gathered `stream_interval` tokens at a time), and keeps one queue per client stream.

Several frontends run in processes of their own beside the core (or one runs inside the core's
process), so the per-token work of many client streams spreads over cores while the engine core
only schedules. A request for n samples is n sequences in the core (one per sample, sharing the
request id; the core computes their prompt once), whose messages share the request's stream. A frontend learns the core's status (up, draining, the context limit) from the
first event of its stream and keeps it current from later ones.

Backpressure: a request may be generated at most `stream_window` tokens ahead of what its client
has read, counted as tokens whose message the gRPC stream accepted (its `yield` returns only as
the transport's flow control lets it, so tokens the client's own HTTP/2 stream window holds count
as read). Past the window the frontend asks the core to pause the request; once the client has
read all but half a window, to resume it. A client that goes away aborts the request, paused or not.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import AsyncIterator

from scheduler_svc.frontend.core_client import CoreClient, CoreUnreachable
from scheduler_svc.engine.api import (AddCode, CoreInfo, CoreRequest, CoreStatus, RequestError, StepOutputs,
                                      make_seq_id)
from scheduler_svc.frontend.output_stream import OutputStream, RequestOutput
from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import FinishReason
from scheduler_svc.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Refused(Exception):
    """The core did not admit the request; `code` says why (AddCode)."""

    def __init__(self, code: AddCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RequestFailed(Exception):
    """A request (one of its samples) failed after admission: its stream raises this, and the
    request's other samples are aborted."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class _Request:
    """One sample of a request: its sequence in the core and its output; the request's samples
    share one queue of messages."""
    request_id: str
    seq_id: int
    stream: OutputStream
    queue: asyncio.Queue
    done: bool = False
    generated: int = 0            # tokens the core sent for it
    delivered: int = 0            # tokens in messages its gRPC stream accepted
    paused: bool = False          # as last asked of the core


class Frontend:
    def __init__(self, core: CoreClient, tokenizer: Tokenizer, *, stream_interval: int = 1,
                 eos_token_ids: Sequence[int] = (), stream_window: int = 0) -> None:
        """`eos_token_ids`: the model's, which end a sample unless it ignores EOS (named in
        matched_stop when one does). `stream_window`: the backpressure window in tokens (0: off)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        if stream_window and stream_window < 2 * stream_interval:
            # Tokens still gathering for a message are not readable yet: a window that small
            # could pause a request before its client had anything to read.
            raise ValueError(f"stream_window must be 0 (off) or at least twice stream_interval "
                             f"({2 * stream_interval}), got {stream_window}")
        self.core = core
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.eos_token_ids = tuple(eos_token_ids)
        self.stream_window = stream_window
        self._pause_changes: dict[int, bool] = {}     # seq_id -> paused, not yet sent to the core
        self._pause_wakeup = asyncio.Event()
        self.status = CoreStatus(False, "not connected to the engine core yet", 0)
        self.status_changed = asyncio.Event()
        self.attached = asyncio.Event()   # set by the core's first status (attaching sends the current one)
        self._requests: dict[int, _Request] = {}      # seq_id -> request in flight
        self._counter = itertools.count(1)
        self._rejected: Counter[str] = Counter()
        self._draining = False

    # -- the event stream ---------------------------------------------------------------------
    async def run(self) -> None:
        """Applies the core's events until the core goes away (then raises CoreUnreachable)."""
        background = [asyncio.create_task(self._report_rejections()),
                      asyncio.create_task(self._send_pause_changes())]
        try:
            async for event in self.core.events():
                if event.status is not None:
                    self._set_status(event.status)
                    self.attached.set()
                if event.outputs is not None:
                    self._apply(event.outputs)
        finally:
            for task in background:
                task.cancel()
            self._set_status(CoreStatus(False, "lost the engine core", 0))
            for req in list(self._requests.values()):
                self._deliver_end(req, req.stream.finish(FinishReason.ABORT, 0))

    def _set_status(self, status: CoreStatus) -> None:
        if status != self.status:
            logger.info("core status: %s", "accepting" if status.accepting else f"not accepting ({status.reason})")
            self.status = status
            self._notify()

    def _notify(self) -> None:
        """Wakes whoever waits on status_changed (taken before reading the state it watches)."""
        self.status_changed.set()
        self.status_changed = asyncio.Event()

    def _apply(self, out: StepOutputs) -> None:
        """One step's prompt scores, tokens and endings for this frontend's requests."""
        requests = self._requests
        logprobs = out.logprobs
        if out.prompt_logprobs is not None:
            self._apply_prompt_logprobs(out)
        top = out.top_logprobs.entries() if out.top_logprobs is not None else None
        touched: list[_Request] = []
        stopped: list[int] = []
        window = self.stream_window
        for i, seq_id in enumerate(out.seq_ids):
            req = requests.get(seq_id)
            if req is None or req.stream.stopped:
                continue
            req.stream.add_token(out.token_ids[i], logprobs[i] if logprobs is not None else None,
                                 top[i] if top is not None else None)
            if req.stream.stopped:
                stopped.append(seq_id)
            else:
                touched.append(req)
                req.generated += 1
                if window and not req.paused and req.generated - req.delivered >= window:
                    self._set_paused(req, True)
        for finished in out.finished:
            req = requests.get(finished.seq_id)
            if req is None:
                continue
            if finished.error is not None:
                self._deliver_end(req, RequestFailed(finished.error))
            else:
                self._deliver_end(req, req.stream.finish(finished.reason, finished.num_cached_prompt_tokens))
        for req in touched:
            if not req.done:
                message = req.stream.ready()
                if message is not None:
                    req.queue.put_nowait(message)
        if stopped:
            # The request ends once the core confirms (with its usage); meanwhile its tokens are
            # dropped here.
            asyncio.ensure_future(self._abort(stopped, FinishReason.STOP, notify=True))

    def _apply_prompt_logprobs(self, out: StepOutputs) -> None:
        prompt = out.prompt_logprobs
        tops = prompt.top.entries() if prompt.top is not None else None
        offset = 0
        for seq_id, count in zip(prompt.seq_ids, prompt.counts):
            req = self._requests.get(seq_id)
            if req is not None:
                req.stream.add_prompt_logprobs(prompt.logprobs[offset:offset + count],
                                               tops[offset:offset + count] if tops is not None else None)
            offset += count

    def _deliver_end(self, req: _Request, message: RequestOutput | RequestFailed) -> None:
        self._requests.pop(req.seq_id, None)
        req.done = True
        req.queue.put_nowait(message)

    # -- requests -------------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self._requests)

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        self._draining = True
        self._notify()

    def count_rejection(self, code: str) -> None:
        self._rejected[code] += 1

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                     ) -> AsyncIterator[RequestOutput]:
        """Admits a validated request (all of its params.n samples, or none); returns the stream
        of its messages, each naming its sample, until every sample has ended. Raises Refused."""
        if self._draining:
            raise Refused(AddCode.UNAVAILABLE, "the server is shutting down")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        samples, adds = [], []
        for index in range(params.n):
            sample = params.for_sample(index)
            seq_id = make_seq_id(self.core.frontend_id, next(self._counter))
            stream = OutputStream.create(self.tokenizer, prompt_token_ids, sample, stream_interval=self.stream_interval,
                                         index=index, eos_token_ids=self.eos_token_ids)
            # Filed before the add: the core may send a first token before the add's answer arrives.
            req = _Request(request_id, seq_id, stream, queue)
            self._requests[seq_id] = req
            samples.append(req)
            adds.append(self.core.add(CoreRequest(seq_id, request_id, prompt_token_ids, sample, index)))
        # Issued in one turn of the event loop: a core client sends them as one batch, in order.
        added = asyncio.gather(*adds)
        try:
            # Shielded: a client that goes away meanwhile must not lose the core's answer, or a
            # request the core admitted would run (and hold its blocks) with nobody to end it.
            results = await asyncio.shield(added)
        except asyncio.CancelledError:
            self._drop(samples)
            asyncio.ensure_future(self._abort_once_added(samples, added))
            raise
        refused = [r for r in results if r.code != AddCode.OK]
        if refused:
            self._drop(samples)
            await self._abort_admitted(samples, results)
            raise Refused(refused[0].code, refused[0].message)
        return self._stream(samples, queue)

    def _drop(self, samples: list[_Request]) -> None:
        for req in samples:
            self._requests.pop(req.seq_id, None)
            req.done = True

    async def _abort_admitted(self, samples: list[_Request], results) -> None:
        admitted = [req.seq_id for req, r in zip(samples, results) if r.code == AddCode.OK]
        if admitted:
            await self._abort(admitted, FinishReason.ABORT, notify=False)

    async def _abort_once_added(self, samples: list[_Request], added: asyncio.Future) -> None:
        """Aborts what the core admitted of a request whose client left during its admission:
        after the core's answer, so the abort cannot overtake the add."""
        try:
            results = await added
        except Exception as e:    # noqa: BLE001 - the adds failed: nothing was admitted
            logger.debug("the adds of a cancelled request failed: %s", e)
            return
        await self._abort_admitted(samples, results)

    async def _stream(self, samples: list[_Request], queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        remaining = len(samples)
        try:
            while remaining:
                message = await queue.get()
                if isinstance(message, RequestFailed):
                    raise message
                yield message
                remaining -= message.finished
                if not message.finished and self.stream_window:
                    # The consumer asks for the next message once gRPC accepted this one.
                    self._delivered(samples[message.index], len(message.token_ids))
        finally:
            # The consumer went away (cancelled stream, deadline): free its samples at once.
            unfinished = [req for req in samples if not req.done]
            for req in unfinished:
                self._requests.pop(req.seq_id, None)
                req.done = True
            if unfinished:
                asyncio.ensure_future(self._abort([r.seq_id for r in unfinished], FinishReason.ABORT, notify=False))

    # -- backpressure ---------------------------------------------------------------------------
    def _delivered(self, req: _Request, num_tokens: int) -> None:
        req.delivered += num_tokens
        if req.paused and req.generated - req.delivered <= self.stream_window // 2:
            self._set_paused(req, False)

    def _set_paused(self, req: _Request, paused: bool) -> None:
        req.paused = paused
        self._pause_changes[req.seq_id] = paused
        self._pause_wakeup.set()

    async def _send_pause_changes(self) -> None:
        """Sends pauses and resumes to the core, one call at a time so they arrive in order; what
        changed meanwhile goes in the next call, only each request's latest state."""
        while True:
            await self._pause_wakeup.wait()
            self._pause_wakeup.clear()
            changes, self._pause_changes = self._pause_changes, {}
            pause = [seq_id for seq_id, paused in changes.items() if paused]
            resume = [seq_id for seq_id, paused in changes.items() if not paused]
            try:
                await self.core.set_paused(pause, resume)
            except CoreUnreachable as e:
                logger.warning("could not pause %d and resume %d requests: %s", len(pause), len(resume), e)

    async def abort(self, request_id: str) -> bool:
        """The public Abort: any frontend's request, by its id."""
        return await self.core.abort_request_id(request_id)

    async def info(self) -> CoreInfo:
        return await self.core.info()

    async def _abort(self, seq_ids: list[int], reason: FinishReason, notify: bool) -> None:
        try:
            await self.core.abort(seq_ids, reason, notify)
        except CoreUnreachable as e:
            logger.warning("could not abort %d requests: %s", len(seq_ids), e)

    async def _report_rejections(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self._rejected:
                rejected, self._rejected = dict(self._rejected), Counter()
                try:
                    await self.core.report(rejected)
                except CoreUnreachable:
                    pass
