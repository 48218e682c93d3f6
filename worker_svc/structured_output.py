"""The worker's side of constrained sampling: one grammar matcher per constrained request, a token
mask per step for the rows that have one, and the sampled tokens fed back in step order.

Grammars are compiled in child processes within a time budget (worker_svc/grammar_pool.py), when
the scheduler prepares a request (PrepareGrammar) before its first step, so a step finds them
compiled; a step that does not (a worker restarted meanwhile) compiles through the same pool.

The runner launches step N+1 before step N's tokens reach the host (their values stay on the
device, see model_runner.py), but a matcher must accept N's token before it can say what N+1 may
sample. So each step that samples constrained rows records a copy of those tokens to the host
behind an event (`record`). The next step with constrained rows starts their masks in the
background before its forward (`start_fill`): one task per row waits for that row's tokens,
accepts them and fills the row, on a pool of threads, while the forward runs. Once the logits
are there, `mask` waits for the tasks and applies the mask. Steps without constrained rows never
come here: no wait, no mask, no tensor.

Each row's task is timed in CPU time (its thread's clock: what the mask costs, however busy the
machine): a row whose mask costs more than `mask_budget_ms` in a step is given up on (the step
waits no longer for it, its row allows only the stop tokens) and its request is reported failed,
so one request's grammar (an ambiguous regex, whose masks grow costlier with every token) costs
the batch at most one budget, once, and never holds up the sampling of the other rows for longer.

Whether structured output is available at all (xgrammar and pydantic import) is checked at
start-up (common/features.py); without it, a constrained request fails with UNIMPLEMENTED naming
the package, and nothing here imports xgrammar. With it, the worker's own compiler (the tokenizer
tables that deserialized grammars and matchers use) is made at start-up too (in the background
on CUDA, beside the graph capture): made by a first constrained request, it would hold the
interpreter lock against the steps running meanwhile.
"""
from __future__ import annotations

import logging
import os
import pathlib
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import NamedTuple

import torch

from common.constraint import Constraint, GrammarError
from common.features import Feature
from worker_svc.grammar_pool import DEFAULT_TIMEOUT_S, GrammarPool
from worker_svc.runner_io import RequestFailure

logger = logging.getLogger(__name__)

# Host buffers the steps' masks take in turn: the steps in flight (up to three) and one more.
MASK_BUFFERS = 4
# Threads compiling one grammar's masks and filling a large batch's bitmask.
_MAX_THREADS = 8
DEFAULT_MASK_BUDGET_MS = 10.0


class FeatureUnavailable(RuntimeError):
    """Structured output is not available on this worker; str() names the missing package."""


class _Failure(NamedTuple):
    code: str
    message: str
    about_constraint: bool


class _DeadEnd(Exception):
    """A matcher that allows no next token, not even a stop token: its grammar has no completion
    from here (`root ::= "a" b` with `b ::= b "c"`), which the compile-time check cannot see."""


class _PendingTokens:
    """Constrained rows' tokens of one launched step, on their way to the host (and, for a step
    that verified drafts, which of them were emitted)."""
    __slots__ = ("tokens", "keep", "event", "_values", "_kept", "_lock")

    def __init__(self, tokens: torch.Tensor, keep: torch.Tensor | None, event) -> None:
        self.tokens, self.keep, self.event = tokens, keep, event
        self._values: list[int] | None = None
        self._kept: list[bool] | None = None
        self._lock = threading.Lock()

    def values(self) -> tuple[list[int], list[bool] | None]:
        """The tokens, and whether each was emitted (None: all were)."""
        with self._lock:
            if self._values is None:
                if self.event is not None:
                    self.event.synchronize()
                self._values = self.tokens.tolist()
                self._kept = self.keep.tolist() if self.keep is not None else None
            return self._values, self._kept


class _RowFill:
    """One request's mask task of one step: accept its pending tokens, fill its bitmask rows (one,
    or a verification's positions: after each row the matcher advances over the draft that follows
    it, next_tokens[i], -1 after the last, and is rolled back once past its rows)."""
    __slots__ = ("matcher", "rows", "next_tokens", "future", "clock", "cpu_start", "cost_ms")

    def __init__(self, matcher, rows: list[int], next_tokens: list[int] | None = None) -> None:
        self.matcher, self.rows, self.next_tokens = matcher, rows, next_tokens
        self.future: Future | None = None
        self.clock = None            # the running thread's CPU clock, once started
        self.cpu_start = 0.0
        self.cost_ms = 0.0

    def cpu_ms(self) -> float:
        """CPU time spent so far (0 while queued)."""
        if self.future.done():
            return self.cost_ms
        clock = self.clock
        if clock is None:
            return 0.0
        try:
            return (_cpu_time(clock) - self.cpu_start) * 1e3
        except OSError:              # the thread ended between the two reads
            return self.cost_ms


class MaskFill:
    """A step's constrained rows being filled in the background (StructuredOutput.start_fill),
    into the host buffer `buffer` of StructuredOutput's MASK_BUFFERS."""
    __slots__ = ("rows", "bitmask", "buffer")

    def __init__(self, rows: list[_RowFill], bitmask: torch.Tensor, buffer: int = 0) -> None:
        self.rows, self.bitmask, self.buffer = rows, bitmask, buffer


class StructuredOutput:
    def __init__(self, model_dir: str | pathlib.Path, vocab_size: int, stop_token_ids: Sequence[int],
                 device: torch.device, *, feature: Feature | None = None,
                 compile_timeout_s: float = DEFAULT_TIMEOUT_S, compile_processes: int = 1,
                 mask_budget_ms: float = DEFAULT_MASK_BUDGET_MS) -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.device = device
        self.feature = feature or Feature("structured_output", True)
        self.mask_budget_ms = mask_budget_ms
        self._compiler = None
        # Host buffers for the steps' masks, in turn: a step's mask reaches the device by a copy that
        # runs after its forward, so the next steps (up to three in flight) fill other buffers; a
        # buffer is filled again only once the copy out of it (its event) is done.
        self._bitmasks: list = [None] * MASK_BUFFERS
        self._copied: list = [None] * MASK_BUFFERS
        self._turn = 0
        self._threads = max(1, min(_MAX_THREADS, (os.cpu_count() or 1) // 2))
        self._fillers = self._new_fillers()
        self._lock = threading.Lock()
        self._pending: deque[tuple[list, _PendingTokens]] = deque()
        self.pool = (GrammarPool(model_dir, vocab_size, stop_token_ids, self._compiler_or_load,
                                 timeout_s=compile_timeout_s, processes=compile_processes)
                     if self.feature.available else None)
        self.num_refused = 0      # sampled tokens a matcher refused (a bug if ever non-zero)
        self.num_over_budget = 0  # requests failed for their masks' cost
        self.num_dead_ends = 0    # requests failed for a grammar that allowed no next token

    def load(self) -> None:
        """Makes the compiler now (the worker's tokenizer tables), so that the first constrained
        request does not: made while steps run, it would hold the interpreter lock against them
        (a third of a second for the tiny model, seconds for a real vocabulary). The compiling
        processes still start at the first grammar."""
        if self.pool is not None:
            self._load_quietly()

    def load_in_background(self) -> None:
        """Starts making the compiler and the compiling processes now, on a thread of its own (a
        first constrained request then waits only for what is left of it)."""
        if self.pool is None:
            return
        self.pool.start()
        threading.Thread(target=self._load_quietly, name="structured-output-load", daemon=True).start()

    def prepare(self, constraint: Constraint) -> None:
        """Compiles the constraint (cached); raises GrammarError when it does not compile or not
        within the budget, FeatureUnavailable without xgrammar."""
        self._check_available()
        self.pool.compile(constraint)

    def matcher(self, constraint: Constraint, output_token_ids: Sequence[int], seq_id: int = 0):
        """A matcher for a request, advanced over the output tokens it already has. Raises
        GrammarError (a ValueError) for a bad constraint or tokens that do not follow it, and
        FeatureUnavailable without xgrammar."""
        self._check_available()
        compiled = self.pool.compile(constraint)
        matcher = self._compiler_or_load().matcher_of(constraint, compiled, output_token_ids)
        # The step's bookkeeping: whose it is, why it was given up on (a _Failure), the recorded
        # tokens it has yet to accept, and what its last mask cost.
        matcher.seq_id, matcher.failed, matcher.pending, matcher.last_cost_ms = seq_id, None, [], 0.0
        return matcher

    def matcher_or_failure(self, seq_id: int, constraint: Constraint, output_token_ids: Sequence[int]):
        """matcher(), or the RequestFailure that ends the request when there can be none."""
        try:
            return self.matcher(constraint, output_token_ids, seq_id)
        except FeatureUnavailable as exc:
            return RequestFailure(seq_id, "UNIMPLEMENTED", str(exc))
        except GrammarError as exc:
            return RequestFailure(seq_id, "INVALID_ARGUMENT", f"is invalid: {exc.problem}", True)
        except Exception as exc:    # noqa: BLE001 - this request's alone: the batch goes on
            logger.exception("request %d: no grammar matcher", seq_id)
            return RequestFailure(seq_id, "INTERNAL", f"its grammar matcher could not be made: {exc!r}")

    # -- a step's masks ---------------------------------------------------------------------------
    def start_fill(self, matchers: list, next_drafts: list[int] | None = None) -> MaskFill:
        """Starts filling the masks of a step's constrained rows (matchers[i] is row i) in the
        background; call before the step's forward, then `mask`. With `next_drafts` the rows are a
        verification's: a matcher repeats over its request's consecutive positions and allows at
        each what follows the drafts before it (next_drafts[i]: the draft after row i, -1 after
        the last)."""
        self._hand_out_pending()
        grammar = _grammar()
        buffer, self._turn = self._turn, (self._turn + 1) % MASK_BUFFERS
        if self._bitmasks[buffer] is None:   # made here, in the step's thread: it allocates pinned memory
            self._bitmasks[buffer] = grammar.GrammarBitmask(self.vocab_size, self.device)
        if self._copied[buffer] is not None:   # the copy of MASK_BUFFERS steps ago (long done in practice)
            self._copied[buffer].synchronize()
            self._copied[buffer] = None
        bitmask = self._bitmasks[buffer].rows(len(matchers))
        rows = _row_tasks(matchers, next_drafts)
        for row in sorted(rows, key=lambda r: r.matcher.last_cost_ms):   # the cheap ones first
            if row.matcher.failed:      # given up on: allows only the stop tokens until it is dropped
                for i in row.rows:
                    grammar.allow_only(bitmask[i], self.stop_token_ids)
                row.future = _done()
            else:
                row.future = self._fillers.submit(self._fill_row, row, bitmask)
        return MaskFill(rows, bitmask, buffer)

    def mask(self, logits: torch.Tensor, positions: list[int], fill: MaskFill) -> list[RequestFailure]:
        """Waits for the step's masks and sets every token a row's matcher does not allow to -inf
        in logits[positions[i]]. Returns the requests given up on in this step (for their masks'
        cost), whose tokens are void."""
        failed = self._wait(fill)
        bitmask = fill.bitmask
        if failed:
            grammar = _grammar()
            bitmask = bitmask.clone()          # a given-up task may still write the shared buffer
            for row in failed:
                for i in row.rows:
                    grammar.allow_only(bitmask[i], self.stop_token_ids)
        _grammar().apply_bitmask(logits, positions, bitmask)
        if logits.is_cuda:   # the buffer is refilled only once this step's copy out of it is done
            self._copied[fill.buffer] = torch.cuda.Event()
            self._copied[fill.buffer].record()
        return [RequestFailure(row.matcher.seq_id, *row.matcher.failed) for row in failed]

    def record(self, matchers: list, tokens: torch.Tensor, positions: torch.Tensor,
               keep: torch.Tensor | None = None) -> None:
        """Queues the tokens a step sampled at `positions` (device) for matchers (in order); with
        `keep` (bool per sampled position, device), only those it marks."""
        chosen = tokens.index_select(0, positions)
        kept = keep.index_select(0, positions) if keep is not None else None
        event = None
        if chosen.device.type == "cuda":
            chosen = chosen.to("cpu", non_blocking=True)
            kept = kept.to("cpu", non_blocking=True) if kept is not None else None
            event = torch.cuda.Event()
            event.record()
        self._pending.append((matchers, _PendingTokens(chosen, kept, event)))

    @property
    def loaded(self) -> bool:
        """Whether the compiler exists (made at start-up, see load)."""
        return self._compiler is not None

    @property
    def masked(self) -> bool:
        """Whether a step has had constrained rows (their masks' buffer exists)."""
        return any(bitmask is not None for bitmask in self._bitmasks)

    def clear(self) -> None:
        """Forgets tokens not accepted yet (the batch was reset: their matchers are gone)."""
        self._pending.clear()

    # -- internals --------------------------------------------------------------------------------
    def _hand_out_pending(self) -> None:
        """Gives each matcher the recorded tokens it has yet to accept, oldest step first."""
        while self._pending:
            matchers, pending = self._pending.popleft()
            for index, matcher in enumerate(matchers):
                if not matcher.failed:       # a given-up task may still be reading its list
                    matcher.pending.append((pending, index))

    def _fill_row(self, row: _RowFill, bitmask: torch.Tensor) -> None:
        # Inference mode is per thread: the step made the bitmask under it, and writing an
        # inference tensor (a terminated row's stop tokens) outside it raises.
        with torch.inference_mode():
            self._fill_row_inferring(row, bitmask)

    def _fill_row_inferring(self, row: _RowFill, bitmask: torch.Tensor) -> None:
        clock = _thread_clock()
        row.cpu_start, row.clock = _cpu_time(clock), clock
        matcher = row.matcher
        for pending, index in matcher.pending:
            tokens, kept = pending.values()
            # A matcher whose request was dropped meanwhile accepts into nothing: harmless.
            if (kept is None or kept[index]) and not matcher.accept_token(tokens[index]):
                self.num_refused += 1
                logger.error("a grammar refused token %d that was sampled under its mask", tokens[index])
        matcher.pending = []
        if row.next_tokens is None:
            matcher.fill_row(bitmask, row.rows[0])
        else:
            _fill_along(matcher, row.rows, row.next_tokens, bitmask)
        row.cost_ms = matcher.last_cost_ms = (_cpu_time(clock) - row.cpu_start) * 1e3
        # A dead end: the first sampled position would draw from no token. (A later position of a
        # verification that is empty only matters if the drafts before it are accepted: left be.)
        if not bitmask[row.rows[0]].any():
            raise _DeadEnd()

    def _wait(self, fill: MaskFill) -> list[_RowFill]:
        """Waits until every row is filled, giving up on each row whose task has cost more than
        the budget (or raised); returns those, their matchers marked failed."""
        budget = self.mask_budget_ms
        waiting = {row.future: row for row in fill.rows if not row.matcher.failed}
        failed: list[_RowFill] = []
        while waiting:
            done, _ = wait(waiting, timeout=0.001, return_when=FIRST_COMPLETED)
            for future in done:
                row = waiting.pop(future)
                error = future.exception()
                if isinstance(error, _DeadEnd):
                    self.num_dead_ends += 1
                    row.matcher.failed = _Failure(
                        "INVALID_ARGUMENT", "allows no token after the output so far: no output that follows it "
                                            "can be completed", True)
                    failed.append(row)
                elif error is not None:
                    logger.error("request %d: its grammar matcher failed", row.matcher.seq_id, exc_info=error)
                    row.matcher.failed = _Failure("INTERNAL", f"its grammar matcher failed: {error!r}", False)
                    failed.append(row)
                elif row.cost_ms > budget:
                    failed.append(row)
            for future, row in list(waiting.items()):
                if row.cpu_ms() > budget:
                    del waiting[future]
                    failed.append(row)
                    self._give_up(fill, waiting)
        for row in failed:
            if row.matcher.failed is None:
                self.num_over_budget += 1
                row.matcher.failed = _Failure(
                    "INVALID_ARGUMENT", f"is too costly to follow: its token mask took {row.cpu_ms():.0f} ms of CPU "
                                        f"in one step, more than the budget of {budget:g} ms (--max-mask-ms)", True)
                logger.warning("request %d given up on: its grammar's mask cost %.0f ms in one step (budget %g ms)",
                               row.matcher.seq_id, row.cpu_ms(), budget)
        return failed

    def _give_up(self, fill: MaskFill, waiting: dict[Future, _RowFill]) -> None:
        """A task runs past the budget and cannot be stopped: it keeps its thread (and the buffer,
        which later steps no longer use), and the rows still queued behind it move to new threads."""
        self._fillers.shutdown(wait=False)
        self._fillers = self._new_fillers()
        self._bitmasks[fill.buffer].abandon()
        for future, row in list(waiting.items()):
            if future.cancel():            # not started: submit it again, to the new threads
                del waiting[future]
                row.future = self._fillers.submit(self._fill_row, row, fill.bitmask)
                waiting[row.future] = row

    def _new_fillers(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=max(2, self._threads), thread_name_prefix="grammar-mask")

    def _check_available(self) -> None:
        if not self.feature.available:
            raise FeatureUnavailable(self.feature.detail)

    def _load_quietly(self) -> None:
        try:
            self._compiler_or_load()
        except Exception:   # noqa: BLE001 - reported here; a constrained request reports it again
            logger.exception("structured output could not be loaded")

    def _compiler_or_load(self):
        with self._lock:
            if self._compiler is None:
                started = time.perf_counter()
                grammar = _grammar()
                # CPU work only (tokenizer tables): safe beside a CUDA-graph capture in another
                # thread, unlike a device or pinned allocation. Compiling happens in the pool.
                self._compiler = grammar.GrammarCompiler.from_model_dir(
                    self.model_dir, self.vocab_size, self.stop_token_ids, max_threads=1)
                logger.info("structured output ready in %.2f s (xgrammar)", time.perf_counter() - started)
            return self._compiler


def _row_tasks(matchers: list, next_drafts: list[int] | None) -> list[_RowFill]:
    """One task per row, or with next_drafts one per run of consecutive rows of one matcher."""
    if next_drafts is None:
        return [_RowFill(matcher, [i]) for i, matcher in enumerate(matchers)]
    tasks: list[_RowFill] = []
    for i, (matcher, token) in enumerate(zip(matchers, next_drafts)):
        if not tasks or tasks[-1].matcher is not matcher:
            tasks.append(_RowFill(matcher, [], []))
        tasks[-1].rows.append(i)
        tasks[-1].next_tokens.append(token)
    return tasks


def _fill_along(matcher, rows: list[int], next_tokens: list[int], bitmask: torch.Tensor) -> None:
    """Fills a verification's rows of one matcher, advancing it over each draft in between (a draft
    it refuses leaves it where it is for its later rows), then rolls it back to where it was."""
    start, refused = matcher.num_accepted, False
    for row, token in zip(rows, next_tokens):
        matcher.fill_row(bitmask, row)
        if token >= 0 and not refused and not matcher.accept_token(token):
            refused = True
    matcher.rollback(matcher.num_accepted - start)


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def _thread_clock():
    """The calling thread's CPU clock (Linux), or None where threads have none."""
    if sys.platform != "linux":
        return None
    return time.pthread_getcpuclockid(threading.get_ident())


def _cpu_time(clock) -> float:
    return time.clock_gettime(clock) if clock is not None else time.perf_counter()


def _grammar():
    """worker_svc.layers.grammar, imported on first use (it imports xgrammar)."""
    from worker_svc.layers import grammar

    return grammar
