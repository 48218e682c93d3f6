"""worker_svc.late_compiles: a Triton compile after start-up is one WARNING naming the kernel."""
from __future__ import annotations

import logging
import types

import pytest

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from worker_svc import late_compiles  # noqa: E402


@pytest.fixture
def watched():
    previous = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    seen = []
    ours = (lambda **kw: seen.append(("before", kw["key"])) and None,
            lambda **kw: seen.append(("after", kw["key"])))
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = ours
    try:
        assert late_compiles.watch_late_compiles()
        yield seen
        late_compiles.stop_watching()
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == ours
    finally:
        late_compiles.stop_watching()
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = previous


def _compile(key: str) -> None:
    params = [types.SimpleNamespace(name=n) for n in ("x_ptr", "n", "BLOCK", "KV_FP8")]
    fn = types.SimpleNamespace(name="_store_kernel", jit_function=types.SimpleNamespace(params=params))
    compile = {"constants": {(2,): 64, (3,): True},
               "signature": {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr", "KV_FP8": "constexpr"},
               "configs": [{(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}]}
    kwargs = dict(key=key, repr="_store_kernel[...]", fn=fn, compile=compile, is_manual_warmup=False,
                  already_compiled=False)
    assert not knobs.runtime.jit_cache_hook(**kwargs)    # falsy: the compile goes ahead
    knobs.runtime.jit_post_compile_hook(**kwargs)


def test_a_compile_after_start_up_is_named_timed_and_counted(watched, caplog):
    with caplog.at_level(logging.WARNING, logger=late_compiles.__name__):
        _compile("k1")
        _compile("k2")
    assert late_compiles.late_compiles() == 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "kernel _store_kernel compiled after start-up in " in messages[0]
    assert messages[0].endswith(": BLOCK=64, KV_FP8=True; multiples of 16: n")   # the int, not the pointer
    # Hooks set before the watcher still run, in order, around each compile.
    assert watched == [("before", "k1"), ("after", "k1"), ("before", "k2"), ("after", "k2")]


def test_watching_twice_installs_once_and_stopping_puts_the_hooks_back(watched):
    hooks = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    assert late_compiles.watch_late_compiles()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == hooks
    late_compiles.stop_watching()
    assert late_compiles.late_compiles() == 0
    _compile("k3")   # the test's hooks alone now
    assert watched == [("before", "k3"), ("after", "k3")]
    assert late_compiles.late_compiles() == 0


def test_a_report_that_fails_does_not_fail_the_compile(watched, monkeypatch):
    monkeypatch.setattr(late_compiles, "_report", lambda kwargs: 1 / 0)
    _compile("k4")   # raises nothing
    assert watched == [("before", "k4"), ("after", "k4")]
