"""bench/stages/attention.py runs end to end on the CPU (tiny shapes, Triton's interpreter): a
row per case and cache type with a small error against the torch reference, the FP8 sweeps'
rows (every kernel and config right) and best decode config, and the JSON the driver reads."""
from __future__ import annotations

import json

import pytest

from tests.support.triton_interpreter import DEVICE, gpu_faithful


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the GPU run is the benchmark itself")
def test_the_attention_stage_runs_on_the_cpu(tmp_path):
    pytest.importorskip("triton")
    from bench.stages import attention

    with gpu_faithful():
        result = attention.run(tmp_path, device="cpu", engine=False)
    assert json.loads((tmp_path / "attention.json").read_text())["stage"] == "attention"
    cases = {(r["case"], r["kv"]) for r in result["cases"]}
    assert cases == {(name, kv) for name, _ in attention.CPU.cases for kv in ("float32", "float8_e4m3fn")}
    assert all(r["err"] < 1e-5 and r["ms"] > 0 for r in result["cases"]), result["cases"]
    assert len(result["sweep"]) == len(attention.CPU.sweep) * 2   # the decode cases
    assert len(result["prefill_sweep"]) == len(attention.CPU.prefill_sweep) * 2   # the mixed case, decodes apart or not
    assert all(r["err"] < 1e-5 for r in result["sweep"] + result["prefill_sweep"]), result["sweep"]
    best = result["best_fp8_decode_launch"]
    assert (best["kernel"], best["kv_tile"], best["num_warps"], best["num_stages"]) in attention.CPU.sweep



@pytest.mark.skipif(DEVICE.type == "cuda", reason="the GPU run is the benchmark itself")
def test_the_compile_tasks_call_every_sweep_config_once_without_a_failure(monkeypatch):
    """What the GPU run's compile processes do, here in this process (the interpreter)."""
    pytest.importorskip("triton")
    from bench.stages import attention

    called = []
    time_launches = attention._time_launches

    def recording(setup, device, cases, launches, **kwargs):
        called.extend((name, launch) for name, _ in cases for launch in launches(name))
        return time_launches(setup, device, cases, launches, **kwargs)
    monkeypatch.setattr(attention, "_time_launches", recording)
    with gpu_faithful():
        failed = [row for task in attention.compile_tasks(attention.CPU, DEVICE, per_task=3)
                  for row in attention._compile_some(*task)]
    assert failed == []
    expected = [(name, launch) for decode, launches in ((True, attention.decode_launches),
                                                        (False, attention.prefill_launches))
                for name, _ in attention._sweep_cases(attention.CPU, decode)
                for launch in launches(attention.CPU, name)]
    assert sorted(map(str, called)) == sorted(map(str, expected))
