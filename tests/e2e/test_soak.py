"""The soak (tools/loadtest/soak.py) in CI: 12 s of load above capacity through a frontend process,
with client cancels, slow readers and one worker SIGKILL + restart; nothing lost, nothing leaked,
metrics agreeing with the clients. Then probe streams, alone and beside hostile clients in turn
(6.5 s of each, in 5 rounds): each hostile request ends with the status its kind expects, the probes
keep receiving tokens in every hostile window, and no hostile request stalls them: their worst gap,
in units of its window's median gap, is at most 3x beside the hostile clients what it is alone
(stall_ratio, the median over the rounds), and their median gap at most 10x (slowdown_ratio). Both
compare windows of one run, each against its own typical gap, so they hold on a busy shared machine.
The raw worst-gap ratio is reported; it also counts the hostile requests' legitimate work on the
CPUs the service shares with them here, so a machine of its own judges it (python -m
tools.loadtest.soak). QWEN3_SERVE_SOAK_S=600 runs it longer (or run the tool itself:
python -m tools.loadtest.soak --duration 600)."""
from __future__ import annotations

import asyncio
import os

import pytest

from tools.loadtest.soak import SoakSettings, format_figures, soak

DURATION_S = float(os.environ.get("QWEN3_SERVE_SOAK_S", "20"))

pytestmark = pytest.mark.timeout(360 + 2 * DURATION_S)


def test_soak_above_capacity_with_cancels_slow_readers_a_worker_restart_and_hostile_clients(
        tiny_model_dir, tmp_path):
    # Five rounds of 1.3 s windows: one round's worst gap on two shared cores varies x1.4-x4.6 with no
    # stall (docs/PERF_NOTES.md v20); a real stall repeats in every round, so the median of five still
    # finds it, where a median of three failed on noise.
    settings = SoakSettings(duration_s=DURATION_S - 8, quiet_s=6.5, hostile_s=6.5, rounds=5, frontends=1,
                            max_gap_ratio=0.0, max_stall_ratio=3.0, max_slowdown_ratio=10.0)
    figures, failures = asyncio.run(soak(settings, tiny_model_dir, tmp_path / "logs"))
    print(format_figures(figures, failures))
    assert failures == []
    # What makes it a soak and not a stroll: each disturbance really happened.
    assert figures["worker_restarts"] == 1 and figures["worker_failures_seen"] >= 1
    # The opening burst is more than the batch and the waiting queue hold, however fast the machine.
    assert settings.burst > settings.max_num_seqs + settings.max_waiting
    assert figures["refused"] > 0, "never above capacity"
    assert figures["cancelled"] > 0 and figures["slow_readers_completed"] > 0
    assert figures["peak_paused"] > 0, "no slow reader was ever paused"
    assert figures["blocks_leaked"] == 0 and figures["errors"] == 0
    assert figures["probe_gaps"] > 20 and figures["min_hostile_window_gaps"] > 0
    assert figures["stall_ratio"] <= settings.max_stall_ratio, figures["round_stall_ratios"]
    assert figures["hostile_outcomes"]["wide_schema"] == {"INVALID_ARGUMENT": figures["hostile_outcomes"][
        "wide_schema"]["INVALID_ARGUMENT"]}


def test_the_soak_s_checks_catch_what_they_are_for():
    """check() on made-up outcomes: each kind of damage is reported, a clean run is not."""
    from common.pb.llm.v1 import generation_pb2 as pb
    from tools.loadtest.soak import CANCELLED, COMPLETED, ERROR, REFUSED, Outcome, check

    refs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    clean = [Outcome(0, 0, "normal", COMPLETED, [1, 2, 3, 4]), Outcome(1, 1, "cancel", CANCELLED, [5, 6]),
             Outcome(2, 1, "normal", REFUSED, [], "RESOURCE_EXHAUSTED: full")]
    group = pb.WorkerGroupInfo(num_kv_blocks=8, num_free_kv_blocks=8)
    metrics = {'llm_requests_finished_total{reason="length"}': 3, 'llm_requests_finished_total{reason="abort"}': 1,
               'llm_requests_rejected_total{code="RESOURCE_EXHAUSTED"}': 1, "llm_sampled_tokens_total": 16,
               "llm_generated_tokens_total": 16, 'llm_worker_failures_total{group="0"}': 1}
    figures, failures = check(clean, refs, group, metrics, num_reference_requests=2)
    assert failures == [] and (figures["completed"], figures["cancelled"], figures["refused"]) == (1, 1, 1)

    damaged = [Outcome(0, 0, "normal", COMPLETED, [1, 2, 9, 4]), Outcome(1, 1, "cancel", CANCELLED, [6]),
               Outcome(2, 1, "slow", ERROR, [5], "UNKNOWN: boom")]
    leaky = pb.WorkerGroupInfo(num_kv_blocks=8, num_free_kv_blocks=6)
    _, failures = check(damaged, refs, leaky, {**metrics, "llm_sampled_tokens_total": 15}, num_reference_requests=2)
    text = "\n".join(failures)
    for problem in ("other tokens than its reference", "not its reference's prefix", "without a clear status",
                    "2 KV blocks", "rejected", "sampled tokens"):
        assert problem in text, problem


def test_the_stall_ratio_catches_a_stall_and_not_a_uniformly_slower_machine():
    """A window whose steps are all twice as slow is a slowdown of 2 and no stall; one long gap
    among normal ones is a stall, whatever the machine's speed."""
    from tools.loadtest.hostile import _round_ratios

    quiet = [0.02] * 99 + [0.03]
    slower = [2 * g for g in quiet]
    assert _round_ratios(quiet, slower) == pytest.approx({"gap_ratio": 2.0, "stall_ratio": 1.0, "slowdown_ratio": 2.0})
    stalled = [0.02] * 99 + [0.3]
    assert _round_ratios(quiet, stalled) == pytest.approx({"gap_ratio": 10.0, "stall_ratio": 10.0, "slowdown_ratio": 1.0})
    assert _round_ratios([slow * 3 for slow in quiet], [slow * 3 for slow in stalled])["stall_ratio"] == pytest.approx(10.0)
