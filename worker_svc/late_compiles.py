"""Kernels compiled after start-up, named in the log.

The worker compiles (or loads from Triton's disk cache) every kernel variant its steps reach while
it starts: warm-up steps, the attention and linear selections, CUDA-graph capture. A variant first
reached while serving compiles on the step's thread, about a second during which every request in
the batch waits (PERF_NOTES v19-v20: an FP8 KV cache's first requests waited seconds for theirs).
`watch_late_compiles` makes each such compile one WARNING that names the kernel, its compile-time
constants and the time it took, so a stall says what caused it, and counts them
(`late_compiles()`). Triton's own hooks (knobs.runtime.jit_cache_hook before a compile,
jit_post_compile_hook after) are chained, not replaced. Without Triton, or under its interpreter
(which compiles nothing), it does nothing."""
from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

MARK = "compiled after start-up"   # in every such line: what a log reader counts (bench/stages/service.py)

_lock = threading.Lock()
_count = 0
_started: dict[int, float] = {}                   # thread -> when its compile began (one at a time)
_installed: tuple | None = None                     # (runtime knobs, previous cache hook, previous post hook)


def late_compiles() -> int:
    """How many kernels compiled since watch_late_compiles."""
    return _count


def watch_late_compiles() -> bool:
    """From now on, logs every Triton kernel compiled in this process; False where there is no
    Triton to watch."""
    global _installed
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = knobs.runtime
    if _installed is not None:
        return True
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def cache_hook(**kwargs) -> bool | None:
        with _lock:
            _started[threading.get_ident()] = time.perf_counter()
        return before(**kwargs) if before else None   # a true answer skips the compile: theirs only

    def post_compile_hook(**kwargs) -> None:
        try:
            _report(kwargs)
        except Exception:   # a report that fails must not fail the kernel
            logger.debug("could not report a late compile", exc_info=True)
        if after:
            after(**kwargs)

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = cache_hook, post_compile_hook
    _installed = (runtime, before, after)
    return True


def stop_watching() -> None:
    """Puts back the hooks found by watch_late_compiles (tests)."""
    global _installed, _count
    if _installed is not None:
        runtime, before, after = _installed
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        _installed = None
    with _lock:
        _started.clear()
        _count = 0


def _report(kwargs: dict) -> None:
    global _count
    with _lock:
        began = _started.pop(threading.get_ident(), None)
        _count += 1
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or str(fn)
    params = getattr(getattr(fn, "jit_function", None), "params", None) or []
    compile_info = kwargs.get("compile") or {}
    constants = compile_info.get("constants") or {}
    shown = ", ".join(f"{_name(k, params)}={v}" for k, v in constants.items() if not callable(v))
    # Integer arguments specialised as multiples of 16 (their other values compile another variant).
    signature, attrs = compile_info.get("signature") or {}, (compile_info.get("configs") or [{}])[0] or {}
    multiples = [n for n in (_name(k, params) for k, v in attrs.items() if v)
                 if str(signature.get(n, "")).startswith(("i", "u"))]
    if multiples:
        shown += f"{'; ' if shown else ''}multiples of 16: {', '.join(multiples)}"
    took = f" in {(time.perf_counter() - began) * 1e3:.0f} ms" if began is not None else ""
    logger.warning("kernel %s %s%s (the step waited for it): %s", name, MARK, took, shown or "no compile-time constants")


def _name(key: object, params: list) -> str:
    """Triton keys constants by the argument's path, a tuple of indices: the parameter's name."""
    if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], int) and key[0] < len(params):
        return getattr(params[key[0]], "name", str(key[0]))
    return str(key)
