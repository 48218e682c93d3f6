"""The grammar pool's compiling processes (worker_svc/grammar_pool.py): a grammar that holds the
only child does not hold up the next constraint, which a spare child compiles; the spare retires
once it is not needed. End-to-end because the pool starts real compiling processes (the slow
grammar is made slow on purpose: tests/support/slow_compiler.py)."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from common.constraint import Constraint
from tests.support.slow_compiler import serve_with_slow_ones
from worker_svc.grammar_pool import COMPILER_NICENESS, MAX_SPARES, STARTUP_TIMEOUT_S, GrammarPool
from worker_svc.layers.grammar import GrammarCompiler

# Its compiling children run niced: on a busy machine each takes minutes to start (the pool allows STARTUP_TIMEOUT_S).
pytestmark = pytest.mark.timeout(900)

VOCAB_SIZE = 512


def _wait_until_held(held) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not held.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert held.exists(), "the slow grammar never reached a compiling child"


def test_a_slow_grammar_does_not_hold_up_the_next_and_the_spare_retires(tiny_model_dir, tmp_path):
    stop_ids = json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"]
    compiler = GrammarCompiler.from_model_dir(tiny_model_dir, VOCAB_SIZE, stop_ids)
    pool = GrammarPool(tiny_model_dir, VOCAB_SIZE, stop_ids, lambda: compiler, timeout_s=200, processes=1,
                       spare_after_s=0.2, serve=serve_with_slow_ones)
    peak, spawn = [0], pool._spawn

    def counted_spawn() -> None:      # called with the pool's lock held
        spawn()
        peak[0] = max(peak[0], pool.started)
    pool._spawn = counted_spawn
    release = tmp_path / "release"
    slow = Constraint("regex", f"slow:{release}|(yes|no)")
    results: dict[str, object] = {}
    slow_thread = threading.Thread(target=lambda: results.update(slow=pool.compile(slow)))
    try:
        slow_thread.start()
        # Wait until the slow grammar holds the only child: were the next one to take it first, the
        # slow one would start a spare of its own, still starting when the next one returns.
        held = tmp_path / "release.held"
        _wait_until_held(held)
        # It holds the only child until `release` exists; this one must not wait for it.
        fast = pool.compile(Constraint("regex", "[0-9]{1,3}"))
        assert fast is not None and slow_thread.is_alive() and not release.exists()
        assert pool.started == 1, "the spare did not retire after its compilation"
        release.touch()
        slow_thread.join(timeout=STARTUP_TIMEOUT_S)
        assert not slow_thread.is_alive() and results["slow"] is not None
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert pool._idle and all(    # compiling yields the CPU to the worker's step loop
            os.getpriority(os.PRIO_PROCESS, child.process.pid) == min(19, ours + COMPILER_NICENESS)
            for child in pool._idle)
        # Several compilations at once beside a slow one: at most MAX_SPARES more children.
        release.unlink()
        held.unlink()
        slow2 = Constraint("regex", f"slow:{release}|(a|b)")
        threading.Thread(target=lambda: results.update(slow2=pool.compile(slow2)), daemon=True).start()
        _wait_until_held(held)     # as above: the others must not take the only child first
        others = [Constraint("regex", f"[a-c]{{{n}}}") for n in range(1, 6)]
        threads = [threading.Thread(target=lambda c=c: results.update({c.text: pool.compile(c)})) for c in others]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=STARTUP_TIMEOUT_S)
        assert all(results.get(c.text) is not None for c in others)
        assert 2 <= peak[0] <= 1 + MAX_SPARES, peak
        release.touch()
    finally:
        release.touch()
        slow_thread.join(timeout=60)
        pool.close()
