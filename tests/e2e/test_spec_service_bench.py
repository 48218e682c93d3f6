"""The spec_service stage of the benchmark (bench/stages/spec_service.py) as a smoke test: a worker
with the tiny configs' random weights, with and without an EAGLE-3 head, and the scheduler over
loopback gRPC. Every request must finish with its tokens, the head's steps must verify drafts (the
scheduler's metrics say so) and the table must print; the times are reported, never asserted."""
from __future__ import annotations

import json

import pytest

from bench.gpu_bench import run_alone

pytestmark = pytest.mark.timeout(300)


def test_spec_service_stage_runs_alone_and_counts_the_heads_verifications(tmp_path, capsys):
    code = run_alone("bench.stages.spec_service", ["--out", str(tmp_path), "--device", "cpu", "--tiny",
                                                   "--spec-service-methods", "none,eagle3"])
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / "spec_service.json").read_text())
    print(printed)   # the table, in the test log
    assert code == 0 and record["ok"], record.get("error")
    rows = {(row["proposer"], row["batch"]): row for row in record["result"]["rows"]}
    assert set(rows) == {(method, b) for method in ("none", "eagle3") for b in (1, 4)}
    assert all(row["step_ms"] > 0 and row["tok_per_s"] > 0 for row in rows.values())
    assert rows[("none", 1)]["verifications"] == 0 < rows[("eagle3", 1)]["verifications"]
    assert rows[("eagle3", 4)]["drafts"] >= rows[("eagle3", 4)]["verifications"] > 0
    assert "at_length_3" in rows[("eagle3", 1)] and "@ len 3" in printed
