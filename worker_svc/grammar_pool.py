"""Grammar compilation off the step path: compiled in child processes, each grammar within a time
budget, the results cached in the worker.

Building a grammar and its token masks costs anything from a millisecond to minutes (a schema of
arrays nested 600 deep takes ~60 s), holds the interpreter lock for much of it, and cannot be
interrupted in a thread. So each compilation runs in a child process that holds its own compiler
for the model's tokenizer: the worker waits for the answer (without the lock) for at most
`timeout_s`; past that the child is killed, a new one is started, and the constraint is refused
with a GrammarError saying it was over budget. The compiled grammar comes back serialized and is
deserialized into the worker's own cache (GrammarCompiler.adopt), where steps find it. Refusals
are remembered too (a bounded number), so a client repeating a bad or slow constraint costs
nothing more.

The children start on first use (or at once with start()), and their start-up (importing
xgrammar and reading the tokenizer, seconds) does not count against any grammar's budget. A
compilation that finds every child busy for SPARE_AFTER_S (a slow grammar, most likely) starts a
spare child, up to MAX_SPARES beyond `processes`, so that one slow grammar does not hold up every
constrained request behind it; a spare retires when it finishes with nobody waiting.

The children run at a lower CPU priority (COMPILER_NICENESS): where the worker's host has few
cores, a grammar compiling takes CPU time from the compilations of other grammars only, not from the
step loop that feeds every running request.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pathlib
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future

from common.constraint import Constraint, GrammarError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 600.0       # a child's start-up (imports, tokenizer); a loaded machine is slow
MAX_REMEMBERED_REFUSALS = 1024
SPARE_AFTER_S = 0.5             # every child busy this long: start a spare
MAX_SPARES = 2
COMPILER_NICENESS = 10          # added to the children's nice value (the worker's stays)


class GrammarPool:
    def __init__(self, model_dir: str | pathlib.Path, vocab_size: int, stop_token_ids: Sequence[int], compiler,
                 *, timeout_s: float = DEFAULT_TIMEOUT_S, processes: int = 1, spare_after_s: float = SPARE_AFTER_S,
                 serve=None) -> None:
        """`compiler`: a callable returning the worker's GrammarCompiler (the cache the compiled
        grammars go to, built from the same tokenizer as the children's). `serve`: the children's
        main (serve_compilations; a module-level function, as the spawned children import it)."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self._args = (str(model_dir), vocab_size, tuple(stop_token_ids))
        self._compiler = compiler
        self.timeout_s = timeout_s
        self._num_processes = processes
        self._max_processes = processes + MAX_SPARES
        self.spare_after_s = spare_after_s
        self._serve = serve or serve_compilations
        self._waiting = 0               # compilations waiting for a child
        self._starting = 0              # children started and not ready yet
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Condition()
        self._idle: list[_Child] = []
        self._started = 0
        self._in_flight: dict[Constraint, Future] = {}
        self._refused: OrderedDict[Constraint, GrammarError] = OrderedDict()
        self.num_timeouts = 0

    @property
    def started(self) -> int:
        """Compiling processes started (or starting) now."""
        return self._started

    def start(self) -> None:
        """Starts the children now (in the background) rather than at the first compilation."""
        with self._lock:
            while self._started < self._num_processes:
                self._spawn()

    def compile(self, constraint: Constraint):
        """The compiled grammar of `constraint` (xgrammar's CompiledGrammar), from the worker's
        cache when it is there. Raises GrammarError for a constraint that does not compile, or not
        within the budget. Thread-safe; concurrent calls for one constraint share one compilation."""
        compiled = self._compiler().cached(constraint)
        if compiled is not None:
            return compiled
        with self._lock:
            refused = self._refused.get(constraint)
            if refused is not None:
                raise refused
            future = self._in_flight.get(constraint)
            owner = future is None
            if owner:
                future = self._in_flight[constraint] = Future()
        if owner:
            try:
                future.set_result(self._compile_in_child(constraint))
            except BaseException as exc:   # noqa: BLE001 - handed to every waiter
                future.set_exception(exc)
            finally:
                with self._lock:
                    del self._in_flight[constraint]
        return future.result()

    def close(self) -> None:
        with self._lock:
            children, self._idle = self._idle, []
        for child in children:
            child.kill()

    # -- children -------------------------------------------------------------------------------
    def _compile_in_child(self, constraint: Constraint):
        child = self._take_child()
        try:
            child.conn.send((constraint.kind, constraint.text))
            started = time.monotonic()
            if not child.conn.poll(self.timeout_s):
                child.kill()
                child = None
                self.num_timeouts += 1
                raise self._refuse(constraint, GrammarError(
                    constraint.kind, f"it takes over {self.timeout_s:g} s to compile, the budget "
                                     f"(--grammar-compile-timeout)"))
            reply = child.conn.recv()
        except (EOFError, OSError) as exc:   # the child died on this constraint
            if child is not None:
                child.kill()
                child = None
            raise self._refuse(constraint, GrammarError(constraint.kind, f"the grammar compiler failed on it ({exc!r})")) from exc
        finally:
            self._give_back(child)
        if reply[0] == "error":
            raise self._refuse(constraint, GrammarError(reply[1], reply[2]))
        logger.info("compiled a %s grammar in %.0f ms", constraint.kind, (time.monotonic() - started) * 1e3)
        return self._compiler().adopt(constraint, reply[1])

    def _refuse(self, constraint: Constraint, error: GrammarError) -> GrammarError:
        with self._lock:
            self._refused[constraint] = error
            while len(self._refused) > MAX_REMEMBERED_REFUSALS:
                self._refused.popitem(last=False)
        return error

    def _take_child(self) -> "_Child":
        with self._lock:
            if not self._idle and self._started < self._num_processes:
                self._spawn()
            self._waiting += 1
            try:
                since = time.monotonic()
                while not self._idle:
                    waited = time.monotonic() - since
                    if waited >= STARTUP_TIMEOUT_S:
                        raise GrammarError("constraint",
                                           f"no grammar compiler process started within {STARTUP_TIMEOUT_S:g} s")
                    # Every child busy this long (a slow grammar, most likely) and none starting: a spare.
                    if waited >= self.spare_after_s and not self._starting and self._started < self._max_processes:
                        self._spawn()
                    self._lock.wait(timeout=self.spare_after_s)
                return self._idle.pop()
            finally:
                self._waiting -= 1

    def _give_back(self, child: "_Child | None") -> None:
        with self._lock:
            if child is None:                 # killed: a new one takes its place, unless it was a spare
                self._started -= 1
                if self._started < self._num_processes:
                    self._spawn()
                return
            if self._spare_unneeded():
                self._started -= 1            # a spare, not needed now: it retires
            else:
                self._idle.append(child)
                self._lock.notify()
                return
        child.kill()

    def _spare_unneeded(self) -> bool:
        """More children than `processes` and no compilation waiting for one (call with the lock held)."""
        return self._started > self._num_processes and not self._waiting

    def _spawn(self) -> None:
        """Starts a child; it joins the idle ones once ready (called with the lock held)."""
        self._started += 1
        self._starting += 1
        threading.Thread(target=self._start_child, name="grammar-pool-start", daemon=True).start()

    def _start_child(self) -> None:
        parent, child_end = self._context.Pipe()
        process = self._context.Process(target=_child_main, args=(self._serve, child_end, *self._args),
                                        name="grammar-compiler", daemon=True)
        process.start()
        child_end.close()
        child = _Child(process, parent)
        try:
            ready = parent.poll(STARTUP_TIMEOUT_S) and parent.recv() == ("ready",)
        except (EOFError, OSError):
            ready = False
        with self._lock:
            self._starting -= 1
            if ready and self._spare_unneeded():
                self._started -= 1            # a spare whose compilation found another child meanwhile
            elif ready:
                self._idle.append(child)
                self._lock.notify()
                return
            else:
                self._started -= 1
        if not ready:
            logger.error("a grammar compiler process did not start (exit code %s)", process.exitcode)
        child.kill()


class _Child:
    __slots__ = ("process", "conn")

    def __init__(self, process, conn) -> None:
        self.process, self.conn = process, conn

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _child_main(serve, conn, *args) -> None:
    """A compiling child: yields the CPU to the worker, then serves."""
    try:
        os.nice(COMPILER_NICENESS)
    except OSError:
        logger.warning("could not lower the grammar compiler's CPU priority")
    serve(conn, *args)


def serve_compilations(conn, model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
    """A child's main: compiles each (kind, text) it receives, answering ("ok", serialized) or
    ("error", kind, problem), until the pipe closes."""
    from worker_svc.layers.grammar import GrammarCompiler   # imports xgrammar, in the child only

    compiler = GrammarCompiler.from_model_dir(model_dir, vocab_size, stop_token_ids, cache_bytes=0)
    conn.send(("ready",))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", compiler.compile(Constraint(kind, text)).serialize_json()))
        except GrammarError as exc:
            conn.send(("error", exc.kind, exc.problem))
        except Exception as exc:    # noqa: BLE001 - whatever xgrammar raises, the worker hears of it
            conn.send(("error", kind, f"{type(exc).__name__}: {exc}"))
