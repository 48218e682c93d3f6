"""The host-path benchmark (bench/host_path_cpu.py) as a smoke test: the real scheduler with two
frontend processes and a worker whose forward is a 5 ms wait, a few streams from a client process.
It must finish every request and time steady decode steps; the ratio is reported, never asserted
(CI machines are shared and slow)."""
from __future__ import annotations

import json
import math

import pytest

from bench import host_path_cpu

pytestmark = pytest.mark.timeout(300)


def test_host_path_benchmark_runs_and_reports_a_ratio(tmp_path, capsys):
    code = host_path_cpu.main(["--out", str(tmp_path), "--num-requests", "12", "--prompt-len", "48",
                               "--max-tokens", "24", "--forward-ms", "5", "--frontends", "2",
                               "--client-processes", "1"])
    printed = capsys.readouterr().out
    [row] = json.loads((tmp_path / "host_path.json").read_text())
    print(printed)   # the table, in the test log
    assert code == 0 and row["failed"] == 0
    assert row["output_tokens"] == 12 * 24
    assert row["decode_steps_timed"] > 0 and math.isfinite(row["ratio"]) and row["ratio"] > 0.5
    assert "step ms" in printed
