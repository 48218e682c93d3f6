"""The worker's side of constrained sampling: one grammar matcher per constrained request, a token
mask per step for the rows that have one, and the sampled tokens fed back in step order.

The runner launches step N+1 before step N's tokens reach the host (their values stay on the
device, see model_runner.py), but a matcher must accept N's token before it can say what N+1 may
sample. So each step that samples constrained rows records a copy of those tokens to the host
behind an event (`record`), and the next step that has constrained rows waits for it (`mask`),
accepts, fills the bitmask and applies it to the logits. The runner enqueues that step's forward
first, so the wait and the CPU work of filling the mask overlap the forward on the device. Steps
without constrained rows never come here: no wait, no mask, no tensor.

The grammar compiler (and xgrammar with it) is made at the first constrained request on the CPU, so
a worker that never sees one never loads it. On CUDA it is made in the background from start-up:
for a real vocabulary (Qwen3's 151,936 tokens) that takes seconds (8.6 s measured on an H200
machine), which a first constrained request would otherwise spend inside a step, pausing every
other request of the batch. Compiled grammars are cached by constraint
(worker_svc/layers/grammar.py). Matchers belong to the persistent batch's rows; a request re-sent
in full (after a preemption or a restart) gets a matcher rebuilt from its output tokens, which the
scheduler holds: the scheduler's tokens are the source of truth.
"""
from __future__ import annotations

import logging
import os
import pathlib
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from common.constraint import Constraint

logger = logging.getLogger(__name__)

# Threads compiling one grammar's masks and filling a large batch's bitmask.
_MAX_THREADS = 8


class _PendingTokens:
    """Constrained rows' tokens of one launched step, on their way to the host (and, for a step
    that verified drafts, which of them were emitted)."""
    __slots__ = ("matchers", "tokens", "keep", "event")

    def __init__(self, matchers: list, tokens: torch.Tensor, keep: torch.Tensor | None, event) -> None:
        self.matchers, self.tokens, self.keep, self.event = matchers, tokens, keep, event


class StructuredOutput:
    def __init__(self, model_dir: str | pathlib.Path, vocab_size: int, stop_token_ids: Sequence[int],
                 device: torch.device) -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.device = device
        self._compiler = None
        self._bitmask = None
        self._threads = max(1, min(_MAX_THREADS, (os.cpu_count() or 1) // 2))
        self._lock = threading.Lock()
        self._pending: deque[_PendingTokens] = deque()
        self.num_refused = 0      # sampled tokens a matcher refused (a bug if ever non-zero)

    def load_in_background(self) -> None:
        """Starts making the compiler now, on a thread of its own (a first constrained request
        then waits only for what is left of it)."""
        threading.Thread(target=self._compiler_or_load, name="structured-output-load", daemon=True).start()

    def matcher(self, constraint: Constraint, output_token_ids: Sequence[int]):
        """A matcher for a request, advanced over the output tokens it already has. Raises
        GrammarError (a ValueError) for a bad constraint or tokens that do not follow it."""
        return self._compiler_or_load().matcher(constraint, output_token_ids)

    def mask(self, logits: torch.Tensor, positions: list[int], matchers: list,
             next_drafts: list[int] | None = None) -> None:
        """Sets every token that matchers[i] does not allow next to -inf in logits[positions[i]],
        after the tokens of earlier steps are accepted (waiting for them). With `next_drafts`
        the positions are a verification's: a matcher repeats over its request's positions and
        allows at each what follows the drafts before it (next_drafts[i]: the draft after
        position i, -1 after the last)."""
        self.accept_pending()
        grammar = _grammar()
        if self._bitmask is None:   # made here, in the step's thread: it allocates pinned memory
            self._bitmask = grammar.GrammarBitmask(self.vocab_size, self.device, max_threads=self._threads)
        bitmask = (self._bitmask.fill(matchers) if next_drafts is None
                   else self._bitmask.fill_along(matchers, next_drafts))
        grammar.apply_bitmask(logits, positions, bitmask)

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
        self._pending.append(_PendingTokens(matchers, chosen, kept, event))

    def accept_pending(self) -> None:
        """Feeds every recorded step's tokens to its matchers, oldest step first, waiting for
        those still on the device."""
        while self._pending:
            pending = self._pending.popleft()
            if pending.event is not None:
                pending.event.synchronize()
            keep = pending.keep.tolist() if pending.keep is not None else [True] * len(pending.matchers)
            for matcher, token, kept in zip(pending.matchers, pending.tokens.tolist(), keep):
                # A matcher whose request was dropped meanwhile accepts into nothing: harmless.
                if kept and not matcher.accept_token(token):
                    self.num_refused += 1
                    logger.error("a grammar refused token %d that was sampled under its mask", token)

    @property
    def loaded(self) -> bool:
        """Whether a constrained request has come (the compiler exists)."""
        return self._compiler is not None

    def clear(self) -> None:
        """Forgets tokens not accepted yet (the batch was reset: their matchers are gone)."""
        self._pending.clear()

    def _compiler_or_load(self):
        with self._lock:
            if self._compiler is None:
                started = time.perf_counter()
                grammar = _grammar()
                # CPU work only (tokenizer tables, grammar compiles): safe beside a CUDA-graph
                # capture in another thread, unlike a device or pinned allocation.
                self._compiler = grammar.GrammarCompiler.from_model_dir(
                    self.model_dir, self.vocab_size, self.stop_token_ids, max_threads=self._threads)
                logger.info("structured output ready in %.2f s (xgrammar, %d threads)",
                            time.perf_counter() - started, self._threads)
            return self._compiler


def _grammar():
    """worker_svc.layers.grammar, imported on first use (it imports xgrammar)."""
    from worker_svc.layers import grammar

    return grammar
