"""The host_path stage of the benchmark (bench/stages/host_path.py) as a smoke test: the real
scheduler with two frontend processes and a worker whose forward is a 5 ms wait, a few streams from
a client process. It must finish every request and time steady decode steps; the ratio is reported,
never asserted (CI machines are shared and slow)."""
from __future__ import annotations

import json
import math

import pytest

from bench.gpu_bench import run_alone

pytestmark = pytest.mark.timeout(300)


def test_host_path_stage_runs_alone_and_reports_a_ratio(tmp_path, capsys):
    code = run_alone("bench.stages.host_path", [
        "--out", str(tmp_path), "--host-path-requests", "12", "--host-path-prompt-len", "48",
        "--host-path-max-tokens", "24", "--forward-ms", "5", "--host-path-frontends", "2", "--client-processes", "1",
        "--device", "cpu"])
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "host_path.json").read_text())
    print(printed)   # the table, in the test log
    assert code == 0 and record["ok"], record.get("error")
    [row] = record["result"]["rows"]
    assert row["failed"] == 0 and row["output_tokens"] == 12 * 24
    assert row["decode_steps_timed"] > 0 and math.isfinite(row["ratio"]) and row["ratio"] > 0.5
    assert "step ms" in printed
