"""Choosing the attention backend at start-up (worker_svc/layers/attention/selection.py), on the
CPU: fake backends, loaders and timers stand in for the GPU ones, so the choice itself (fastest
wins, what cannot load or run is skipped with one log line, ranks agree, a named backend is
taken as it is) is tested without a device. The real warm-up and measurement run once on the
torch backend with tiny shapes."""
from __future__ import annotations

import ast
import importlib.util
import dataclasses
import logging
import math
import pathlib
import typing

import pytest
import torch

from worker_svc.layers.attention.base import AttentionBackend
from worker_svc.layers.attention.registry import _BACKENDS as BACKEND_CLASSES
from worker_svc.layers.attention.registry import get_attention_backend
from tests.support.markers import requires_cuda
from worker_svc.layers.attention.selection import (
    AttentionShape, measure_backend, measurement_cases, select_attention_backend, synthetic_step, time_per_call,
    warm_up_backend, warm_up_cases,
)

QWEN3_0_6B = AttentionShape(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16,
                            max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=40960)
TINY = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=16,
                      max_num_seqs=6, max_num_batched_tokens=48, max_model_len=96)
CUDA = torch.device("cuda")   # only named: the fakes never touch a device


class FakeBackend:
    supports_cuda_graphs = True
    supports_mixed_graphs = True

    def __init__(self, name: str, block_size_multiple: int = 1) -> None:
        self.name = name
        self.block_size_multiple = block_size_multiple
        self.reads_fp8_kv = name != "flash_attn"   # as the real ones


class FakeDevice:
    """What the candidates do on a pretend GPU: per-case milliseconds, or an exception at load
    or at warm-up; and a record of what was called."""

    def __init__(self, times: dict[str, dict[str, float]], cannot_load: dict[str, Exception] | None = None,
                 fails: dict[str, Exception] | None = None, block_size_multiples: dict[str, int] | None = None) -> None:
        self.times, self.cannot_load, self.fails = times, cannot_load or {}, fails or {}
        self.block_size_multiples = block_size_multiples or {}
        self.loaded: list[str] = []
        self.warmed: list[str] = []
        self.measured: list[str] = []

    def load(self, name: str) -> FakeBackend:
        self.loaded.append(name)
        if name in self.cannot_load:
            raise self.cannot_load[name]
        return FakeBackend(name, self.block_size_multiples.get(name, 1))

    def warm_up(self, backend, shape, device) -> float:
        self.warmed.append(backend.name)
        if backend.name in self.fails:
            raise self.fails[backend.name]
        return 1.5

    def measure(self, backend, shape, device) -> dict[str, float]:
        self.measured.append(backend.name)
        return self.times[backend.name]

    def select(self, requested="auto", device=CUDA, candidates=("flash_attn", "triton"), shape=QWEN3_0_6B,
               **kwargs):
        return select_attention_backend(requested, device, shape, candidates=candidates, load=self.load,
                                        warm_up=self.warm_up, measure=self.measure, **kwargs)


def selection_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.endswith("selection")]


def test_auto_picks_the_backend_with_the_least_total_time(caplog):
    caplog.set_level(logging.INFO)
    # flash_attn wins the big decode, triton the rest by more.
    device = FakeDevice({"flash_attn": {"decode b=1": 0.30, "decode b=256": 0.20, "prompt": 0.50},
                         "triton": {"decode b=1": 0.05, "decode b=256": 0.25, "prompt": 0.40}})
    chosen = device.select()
    assert chosen.name == "triton"
    assert device.warmed == ["flash_attn", "triton"] and device.measured == ["flash_attn", "triton"]
    assert "attention backend triton chosen (total ms per layer over the measured steps: flash_attn 1.000, " \
           "triton 0.700)" in selection_lines(caplog)


@pytest.mark.parametrize("flaw,why", [
    ({"cannot_load": {"flash_attn": ImportError("No module named 'flash_attn'\n(more detail)")}},
     "it cannot load here (ImportError: No module named 'flash_attn')"),
    ({"block_size_multiples": {"flash_attn": 64}}, "it takes KV blocks of a multiple of 64 tokens, not 16"),
], ids=["cannot-load", "block-size"])
def test_a_backend_that_cannot_serve_is_skipped_before_warm_up_with_one_line_saying_why(caplog, flaw, why):
    caplog.set_level(logging.INFO)
    device = FakeDevice({"triton": {"decode": 0.1}}, **flaw)
    assert device.select().name == "triton"
    about_flash = [line for line in selection_lines(caplog) if "flash_attn" in line]
    assert about_flash == [f"attention backend flash_attn skipped: {why}"]
    assert device.warmed == ["triton"]


def test_a_backend_that_fails_on_the_models_shapes_is_skipped(caplog):
    caplog.set_level(logging.INFO)
    device = FakeDevice({"triton": {"decode": 0.1}}, fails={"flash_attn": AssertionError("head_dim 320 unsupported")})
    assert device.select().name == "triton"
    about_flash = [line for line in selection_lines(caplog) if "flash_attn" in line]
    assert len(about_flash) == 1
    assert "flash_attn skipped: it fails on this model's attention" in about_flash[0]
    assert "AssertionError: head_dim 320 unsupported" in about_flash[0]
    assert device.measured == ["triton"]


def test_when_no_accelerated_backend_runs_torch_does(caplog):
    caplog.set_level(logging.INFO)
    device = FakeDevice({}, cannot_load={"flash_attn": ImportError("no flash_attn"),
                                         "triton": ImportError("no triton")})
    assert device.select().name == "torch"
    assert any("attention runs on torch" in line for line in selection_lines(caplog))


def test_on_the_cpu_torch_is_chosen_without_loading_or_measuring_anything():
    device = FakeDevice({})
    assert device.select(device=torch.device("cpu")).name == "torch"
    assert device.loaded == device.warmed == device.measured == []


def test_ranks_agree_on_the_backend_fastest_for_the_slowest_rank():
    device = FakeDevice({"flash_attn": {"decode": 0.30}, "triton": {"decode": 0.40}},
                        cannot_load={"other": ImportError("absent on this rank")})
    seen = []

    def another_rank_is_slow_on_flash_attn(totals: list[float]) -> list[float]:
        seen.append(totals)
        theirs = [0.90, 0.41, 0.10]
        return [max(a, b) for a, b in zip(totals, theirs)]

    chosen = device.select(candidates=("flash_attn", "triton", "other"),
                           reduce_across_ranks=another_rank_is_slow_on_flash_attn)
    # Every candidate is reported, in order; one that did not run here counts as infinitely slow.
    assert seen == [[0.30, 0.40, math.inf]]
    assert chosen.name == "triton"


def test_a_named_backend_is_warmed_up_and_never_measured(caplog):
    caplog.set_level(logging.INFO)
    device = FakeDevice({})
    assert device.select("flash_attn").name == "flash_attn"
    assert device.warmed == ["flash_attn"] and device.measured == []
    assert "attention backend flash_attn (as requested): warm-up 1.5 s" in selection_lines(caplog)


def test_a_named_backend_that_cannot_run_is_an_error_naming_why():
    device = FakeDevice({}, cannot_load={"flash_attn": ImportError("No module named 'flash_attn'")})
    with pytest.raises(ValueError, match="'flash_attn' is not available: ImportError: No module named 'flash_attn'"):
        device.select("flash_attn")
    failing = FakeDevice({}, fails={"triton": RuntimeError("out of shared memory")})
    with pytest.raises(ValueError, match="'triton' fails on this model's attention .*head_dim 128.*out of shared"):
        failing.select("triton")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        device.select("triton", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend 'nonesuch'"):
        device.select("nonesuch")
    coarse = FakeDevice({}, block_size_multiples={"triton": 64})
    with pytest.raises(ValueError, match="'triton' takes KV blocks of a multiple of 64 tokens, not 16: choose"):
        coarse.select("triton")
    assert coarse.warmed == []


def test_every_backend_declares_the_facts_of_the_protocol():
    facts = set(typing.get_type_hints(AttentionBackend))
    assert facts == {"name", "supports_cuda_graphs", "supports_mixed_graphs", "block_size_multiple", "reads_fp8_kv",
                     "fuses_decode_qk"}
    for module_name, class_name in BACKEND_CLASSES.values():
        # Read from the source, as flash_attn's module imports only where FlashAttention-4 is installed.
        tree = ast.parse(pathlib.Path(importlib.util.find_spec(module_name).origin).read_text())
        (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
        declared = {target.id for node in cls.body if isinstance(node, ast.Assign) for target in node.targets}
        assert facts <= declared, f"{class_name} does not declare {sorted(facts - declared)}"
        methods = {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}
        assert {"forward", "attend", "variant_request_counts"} <= methods, class_name
        fuses = [node.value.value for node in cls.body if isinstance(node, ast.Assign)
                 for target in node.targets if target.id == "fuses_decode_qk"]
        assert fuses in ([True], [False]), class_name
        assert fuses == [("attend_decode_qk" in methods)], f"{class_name}: fuses_decode_qk and attend_decode_qk disagree"


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16", "fp8"])
def test_the_triton_variant_counts_reach_every_decode_launch_a_step_of_any_size_takes(monkeypatch, kv_fp8):
    """Every batch size's (launch config, split-K factor) of pure-decode steps, and of mixed steps
    whose decodes go apart (an FP8 cache's), is that of one warmed-up request count: no step of
    any size compiles after start-up."""
    from worker_svc.layers.attention import triton_kernels as tk

    monkeypatch.setattr(tk, "_multiprocessor_count", lambda device: 132)   # an H100's / H200's

    def key(n, launch_of):
        launch = launch_of(n)
        return launch, tk.decode_num_splits(n, 8, CUDA, launch.num_warps)

    pure, mixed = tk.decode_variant_counts(8, 256, kv_fp8, CUDA)
    decode = lambda n: tk.decode_launch(kv_fp8, n)   # noqa: E731
    assert {key(n, decode) for n in range(1, 257)} == {key(n, decode) for n in pure}
    assert pure[0] == 1 and len(pure) > 1
    if kv_fp8:   # the ~10 variants v19's first requests compiled
        assert {key(n, tk.gqa_decode_launch) for n in range(1, 257)} == {key(n, tk.gqa_decode_launch) for n in mixed}
        assert len(mixed) >= 5
    else:
        assert mixed == []
    shape = dataclasses.replace(QWEN3_0_6B, kv_cache_dtype=torch.float8_e4m3fn if kv_fp8 else None)
    cases = warm_up_cases(shape, (pure, mixed))
    decodes = {len(c.requests) for c in cases if c.pure_decode}
    mixes = {len(c.requests) for c in cases if not c.pure_decode}
    assert set(pure) <= decodes and set(mixed) <= mixes


FP8_KV = dataclasses.replace(QWEN3_0_6B, kv_cache_dtype=torch.float8_e4m3fn)


def test_with_an_fp8_kv_cache_auto_skips_a_backend_that_cannot_read_it_in_one_line(caplog):
    caplog.set_level(logging.INFO)
    device = FakeDevice({"flash_attn": {"decode": 0.01}, "triton": {"decode": 0.1}})
    assert device.select(shape=FP8_KV).name == "triton"
    about_flash = [line for line in selection_lines(caplog) if "flash_attn" in line]
    assert about_flash == ["attention backend flash_attn skipped: it cannot read an fp8 KV cache"]
    assert device.warmed == device.measured == ["triton"]


def test_a_named_backend_that_cannot_read_the_fp8_kv_cache_is_an_error():
    with pytest.raises(ValueError, match="'flash_attn' cannot read an fp8 KV cache"):
        FakeDevice({}).select("flash_attn", shape=FP8_KV)
    assert FakeDevice({}).select("triton", shape=FP8_KV).name == "triton"


def test_synthetic_fp8_steps_hold_quantized_random_values():
    from worker_svc.layers.attention.selection import synthetic_kv_scales

    shape = dataclasses.replace(TINY, kv_cache_dtype=torch.float8_e4m3fn)
    _, _, _, k_cache, v_cache, _ = synthetic_step([(40, 1)], shape, torch.device("cpu"))
    scales = synthetic_kv_scales(shape, torch.device("cpu"))
    assert k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
    values = k_cache.float() * scales.k[0]
    assert 0.5 < values.std().item() < 2.0   # unit-variance K read back through the scales
    assert synthetic_kv_scales(TINY, torch.device("cpu")) is None


@pytest.mark.parametrize("shape", [QWEN3_0_6B, TINY], ids=["qwen3-0.6b", "tiny"])
def test_warm_up_and_measured_steps_stay_within_the_workers_limits(shape):
    every_count = (range(1, shape.max_num_seqs + 1), range(1, shape.max_num_seqs + 1))
    for case in warm_up_cases(shape) + warm_up_cases(shape, every_count) + measurement_cases(shape):
        assert 1 <= len(case.requests) <= shape.max_num_seqs, case.name
        assert sum(new for _, new in case.requests) <= shape.max_num_batched_tokens, case.name
        assert all(cached + new <= shape.max_model_len and new >= 1 for cached, new in case.requests), case.name
    warm = warm_up_cases(shape)
    # Both kinds of step, each with one request and with as many rows as a step may have.
    assert {c.pure_decode for c in warm} == {True, False}
    assert max(len(c.requests) for c in warm if c.pure_decode) == shape.max_num_seqs
    assert min(len(c.requests) for c in warm) == 1


def test_measured_steps_of_qwen3_cover_small_and_full_decode_a_mixed_chunk_and_a_prompt():
    names = [c.name for c in measurement_cases(QWEN3_0_6B)]
    assert names == ["decode b=1 ctx=2048", "decode b=256 ctx=2048", "chunk 512 over 2048 + 255 decodes",
                     "prompt 2048"]


@pytest.mark.parametrize("pool_blocks", [None, 5])
def test_synthetic_steps_write_each_new_token_into_its_own_requests_blocks(pool_blocks):
    requests = [(5, 1), (0, 20), (33, 3)]
    q, k, v, k_cache, v_cache, meta = synthetic_step(requests, TINY, torch.device("cpu"), pool_blocks=pool_blocks)
    assert q.shape == (24, TINY.num_heads, TINY.head_dim)
    assert k.shape == v.shape == (24, TINY.num_kv_heads, TINY.head_dim)
    assert meta.query_start_loc.tolist() == [0, 1, 21, 24] and meta.seq_lens.tolist() == [6, 20, 36]
    expected = []
    for r, (cached, new) in enumerate(requests):
        for pos in range(cached, cached + new):
            expected.append(int(meta.block_tables[r, pos // 16]) * 16 + pos % 16)
    assert meta.slot_mapping.tolist() == expected
    if pool_blocks is None:   # every block belongs to one request
        owned = [int(b) for r, s in enumerate(meta.seq_lens_cpu) for b in meta.block_tables[r, :-(-s // 16)]]
        assert sorted(owned) == list(range(k_cache.shape[0]))
    else:
        assert k_cache.shape[0] == pool_blocks and int(meta.block_tables.max()) < pool_blocks


def test_time_per_call_runs_the_call_once_then_rounds_of_calls():
    calls = []
    ms = time_per_call(lambda: calls.append(1), torch.device("cpu"), calls=4, rounds=3)
    assert len(calls) == 1 + 4 * 3 and ms >= 0


@pytest.mark.parametrize("kv_cache_dtype", [None, torch.float8_e4m3fn], ids=["model-dtype-kv", "fp8-kv"])
def test_the_real_warm_up_and_measurement_run_the_torch_backend(kv_cache_dtype):
    shape = dataclasses.replace(TINY, kv_cache_dtype=kv_cache_dtype)
    backend = get_attention_backend("torch", "cpu")
    assert warm_up_backend(backend, shape, torch.device("cpu")) > 0
    times = measure_backend(backend, shape, torch.device("cpu"), calls=2, rounds=1)
    assert list(times) == [c.name for c in measurement_cases(shape)]
    assert all(t > 0 for t in times.values())


cuda = requires_cuda


@cuda
def test_on_a_gpu_the_worker_runs_and_reports_the_backend_auto_chose(tiny_model_dir, caplog):
    from worker_svc.config import WorkerConfig
    from worker_svc.model_runner import ModelRunner

    caplog.set_level(logging.INFO)
    runner = ModelRunner(WorkerConfig(model=str(tiny_model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                      max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512))
    chosen = runner.describe().attention_backend
    assert chosen in ("flash_attn", "triton")
    assert any(line.startswith(f"attention backend {chosen} chosen") for line in selection_lines(caplog))


@cuda
def test_flash_attn_kernels_compiled_once_load_from_disk_after_a_restart(tmp_path):
    """Two processes warm up the same shapes with one cache folder: the second compiles nothing."""
    import importlib.util
    import pathlib
    import subprocess
    import sys

    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn (FlashAttention-4) is not installed")
    script = (
        "import sys, torch\n"
        "from worker_svc.layers.attention import configure_kernel_cache\n"
        "configure_kernel_cache(sys.argv[1])\n"
        "from worker_svc.layers.attention.registry import load_backend\n"
        "from worker_svc.layers.attention.selection import AttentionShape, warm_up_backend\n"
        "shape = AttentionShape(4, 2, 64, torch.bfloat16, 16, 4, 64, 256)\n"
        "print(warm_up_backend(load_backend('flash_attn'), shape, torch.device('cuda')))\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]

    def warm_up_seconds() -> float:
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=root, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return float(done.stdout.strip().splitlines()[-1])

    first = warm_up_seconds()
    assert list((tmp_path / "flash_attn_cute").rglob("*.o")), "nothing was written to the kernel cache"
    second = warm_up_seconds()
    assert second < first / 3, f"warm-up took {first:.1f} s, then {second:.1f} s with the kernels on disk"


@cuda
@pytest.mark.parametrize("kv_cache_dtype", [None, torch.float8_e4m3fn], ids=["bf16-kv", "fp8-kv"])
def test_after_the_triton_warm_up_no_step_compiles_a_kernel(kv_cache_dtype):
    """The service's first requests waited ~1 s per kernel variant that the warm-up had not
    compiled (PERF_NOTES v27: block tables of one column, or of a width of another class than the
    warm-up's, were variants of their own). After the warm-up, steps of any size, mixed or not,
    over block tables of any width, compile nothing."""
    from worker_svc.late_compiles import late_compiles, stop_watching, watch_late_compiles
    from worker_svc.layers.attention.selection import run_step, synthetic_kv_scales

    shape = dataclasses.replace(QWEN3_0_6B, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048,
                                kv_cache_dtype=kv_cache_dtype)
    backend = get_attention_backend("triton", CUDA)
    warm_up_backend(backend, shape, CUDA)
    kv_scales, scale = synthetic_kv_scales(shape, CUDA), shape.head_dim ** -0.5
    watch_late_compiles()
    try:
        for i, context in enumerate((3, 15, 40, 255, 256, 700)):   # tables of 1, 1, 3, 16, 17 and 44 blocks
            for n in (1, 2, 5, 17, 33, 64):
                decodes = ((context, 1),) * n
                for requests in (decodes, ((0, 20),) + decodes[1:], ((context, 9),) + decodes[1:]):
                    step = synthetic_step(requests, shape, CUDA, pool_blocks=64, seed=i * 100 + n)
                    run_step(backend, step, scale, kv_scales)
        torch.cuda.synchronize()
        assert late_compiles() == 0
    finally:
        stop_watching()
