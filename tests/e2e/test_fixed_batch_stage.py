"""The decode_<model>_<dtype> stages (bench/stages/fixed_batch.py) on the tiny 8B stand-in, bf16 and
FP8, on the CPU: the decode time is the span of the steps' own tokens as the engine returned them
(one prefill step, then --fixed-steps decode steps), not the difference of two calls' times, and
the table prints each step's median and 90th percentile. Times are reported, never asserted."""
from __future__ import annotations

import json

import pytest

from bench.gpu_bench import main

pytestmark = pytest.mark.timeout(300)


def test_decode_stages_time_the_steps_themselves(tmp_path, capsys):
    code = main(["--stages", "decode_8b_bf16,decode_8b_fp8", "--out", str(tmp_path), "--device", "cpu", "--tiny"])
    printed = capsys.readouterr().out
    print(printed)
    records = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("decode_8b_bf16", "decode_8b_fp8")}
    assert code == 0 and all(r["ok"] for r in records.values()), {n: r.get("error") for n, r in records.items()}
    for record in records.values():
        r = record["result"]
        assert r["tok_per_s"] == pytest.approx(r["batch"] * r["steps"] / r["decode_s"])
        # the span holds `steps` intervals: their median and 90th percentile lie within it
        assert 0 < r["step_ms_median"] <= r["step_ms_p90"] <= r["decode_s"] * 1e3
        assert r["step_ms_median"] * r["steps"] < 2 * r["decode_s"] * 1e3
        # the span leaves out the call's start-up and prefill, which the old difference of two calls kept in
        assert r["decode_s"] < r["decode_s_by_difference"] + r["prefill_s"]
        # the mean step is the span over its intervals; the slow steps named lie over 1.5x the median
        assert r["step_ms_mean"] == pytest.approx(r["decode_s"] * 1e3 / r["steps"])
        assert all(0 <= i < r["steps"] and ms > 1.5 * r["step_ms_median"] for i, ms in r["slow_steps"])
    assert "step p50" in printed and "tiny 8b fp8" in printed
    assert {r["result"]["lm_head_dtype"] for r in records.values()} == {"auto"}
    # the FP8 model with its LM head in FP8 too (--lm-head-dtype fp8)
    code = main(["--stages", "decode_8b_fp8", "--out", str(tmp_path / "head"), "--device", "cpu", "--tiny",
                 "--fixed-lm-head-dtype", "fp8"])
    record = json.loads((tmp_path / "head" / "decode_8b_fp8.json").read_text())
    assert code == 0 and record["ok"] and record["result"]["lm_head_dtype"] == "fp8", record.get("error")
