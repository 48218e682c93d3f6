"""Unit tests of the load test's metric math, arrival process and datasets, on hand-made inputs."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tools.loadtest import datasets
from tools.loadtest.arrivals import arrival_offsets
from tools.loadtest.metrics import (
    LatencyStats,
    RequestRecord,
    RunResult,
    meets_slos,
    output_throughput_over_time,
    parse_slos,
    requests_in_flight,
    slo_attainment,
    summarize,
)


def make_record(messages: list[tuple[float, int]], e2e_s: float, *, start_s: float = 0.0, status: str = "OK",
                prompt_tokens: int = 10, cached: int = 0) -> RequestRecord:
    record = RequestRecord("r", start_s=start_s, requested_tokens=None, status=status, e2e_s=e2e_s,
                           prompt_tokens=prompt_tokens, cached_prompt_tokens=cached)
    for elapsed, tokens in messages:
        record.observe_message(elapsed, tokens)
    return record


def reference_percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, written out by hand."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def test_latency_stats_by_hand():
    stats = LatencyStats.of([0.004, 0.001, 0.003, 0.002])
    assert stats.count == 4
    assert stats.mean_ms == pytest.approx(2.5)
    assert stats.median_ms == pytest.approx(2.5)
    assert stats.p90_ms == pytest.approx(3.7)  # rank 0.9*3 = 2.7: 3 + 0.7*(4-3)
    assert stats.p99_ms == pytest.approx(3.97)
    assert stats.max_ms == pytest.approx(4.0)
    assert LatencyStats.of([]) is None


def test_latency_stats_match_reference_on_random_samples():
    rng = np.random.default_rng()
    for _ in range(20):
        values = list(rng.exponential(0.05, size=int(rng.integers(1, 300))))
        stats = LatencyStats.of(values)
        assert stats.mean_ms == pytest.approx(1000 * sum(values) / len(values))
        assert stats.median_ms == pytest.approx(1000 * reference_percentile(values, 50))
        assert stats.p90_ms == pytest.approx(1000 * reference_percentile(values, 90))
        assert stats.p99_ms == pytest.approx(1000 * reference_percentile(values, 99))
        assert stats.max_ms == pytest.approx(1000 * max(values))


def test_ttft_itl_tpot_with_a_multi_token_message():
    # 1 token at 100 ms, then 2 tokens together at 150 ms, 1 more at 300 ms, and a usage-only end message.
    record = make_record([(0.100, 1), (0.150, 2), (0.300, 1), (0.310, 0)], e2e_s=0.320)
    assert record.ttft_s == pytest.approx(0.100)
    assert record.output_tokens == 4
    # One gap per message, as vLLM counts chunks; the 2-token message is a single 50 ms gap.
    assert record.itls_s == pytest.approx([0.050, 0.150])
    # TPOT spreads the time after the first token over every later token.
    assert record.tpot_s == pytest.approx((0.320 - 0.100) / 3)


def test_tpot_undefined_for_one_token_but_counts_as_zero_for_goodput():
    record = make_record([(0.050, 1)], e2e_s=0.060)
    assert record.tpot_s is None and record.itls_s == []
    assert meets_slos(record, {"tpot": 0.001})
    assert meets_slos(record, {"ttft": 50.0, "e2el": 60.0})
    assert not meets_slos(record, {"ttft": 49.0})


def test_failed_requests_never_meet_slos():
    record = make_record([(0.010, 1)], e2e_s=0.020, status="UNAVAILABLE")
    assert not meets_slos(record, {"ttft": 1e9})


def test_parse_slos():
    assert parse_slos(["ttft:500", "tpot:50.5", "e2el:3000"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 3000.0}
    assert parse_slos([]) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_summarize_counts_failures_and_computes_throughput_goodput_and_hit_rate():
    fast = make_record([(0.1, 1), (0.2, 1), (0.3, 1)], e2e_s=0.3, prompt_tokens=100, cached=60)
    slow = make_record([(0.9, 2), (1.0, 2)], e2e_s=1.1, prompt_tokens=50, cached=0)
    single = make_record([(0.2, 1)], e2e_s=0.2, prompt_tokens=10, cached=10)
    failures = [make_record([], e2e_s=0.5, status=code, prompt_tokens=0)
                for code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAVAILABLE")]
    result = RunResult(request_rate=4.0, duration_s=2.0, records=[fast, failures[0], slow, failures[1], single, failures[2]])
    s = summarize(result, {"ttft": 500.0, "tpot": 150.0})
    assert (s.completed, s.failed) == (3, 3)
    assert s.failed_by_code == {"UNAVAILABLE": 2, "DEADLINE_EXCEEDED": 1}
    assert (s.total_prompt_tokens, s.total_output_tokens, s.cached_prompt_tokens) == (160, 8, 70)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.0)
    assert s.total_token_throughput == pytest.approx(84.0)
    assert s.prefix_cache_hit_rate == pytest.approx(70 / 160)
    # fast (ttft 100, tpot 100) and single (ttft 200, tpot 0) are good; slow's TTFT is 900 ms.
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.ttft.count == 3 and s.ttft.max_ms == pytest.approx(900.0)
    assert s.tpot.count == 2  # the one-token request has no TPOT
    assert s.tpot.mean_ms == pytest.approx((100.0 + 200.0 / 3) / 2)  # fast: 200 ms / 2, slow: 200 ms / 3
    assert s.itl.count == 3  # fast's 2 gaps + slow's 1; pooled over requests
    assert s.itl.max_ms == pytest.approx(100.0)
    assert s.e2el.median_ms == pytest.approx(300.0)


def test_slo_attainment_counts_each_slo_and_all_of_them_over_every_request():
    fast = make_record([(0.1, 1), (0.2, 1), (0.3, 1)], e2e_s=0.3)          # ttft 100, tpot 100
    slow_start = make_record([(0.9, 2), (1.0, 2)], e2e_s=1.1)            # ttft 900, tpot 66.7
    slow_tokens = make_record([(0.1, 1), (0.5, 1)], e2e_s=0.5)           # ttft 100, tpot 400
    failed = make_record([], e2e_s=0.5, status="UNAVAILABLE")
    shares = slo_attainment([fast, slow_start, slow_tokens, failed], {"ttft": 500.0, "tpot": 150.0})
    assert shares == {"ttft": 0.5, "tpot": 0.5, "all": 0.25}
    assert slo_attainment([], {"ttft": 1.0}) == {}


def test_summarize_without_slos_or_completions():
    result = RunResult(request_rate=math.inf, duration_s=1.0, records=[make_record([], 0.1, status="UNAVAILABLE")])
    s = summarize(result, {})
    assert s.goodput is None and s.prefix_cache_hit_rate is None and s.ttft is None
    assert s.completed == 0 and s.failed_by_code == {"UNAVAILABLE": 1}


def test_output_throughput_over_time_bins_tokens_by_arrival():
    a = make_record([(0.05, 1), (0.15, 3)], e2e_s=0.2, start_s=0.0)
    b = make_record([(0.10, 2)], e2e_s=0.2, start_s=0.25)  # arrives at 0.35
    failed = make_record([(0.01, 5)], e2e_s=0.1, status="CANCELLED")
    edges, rate = output_throughput_over_time([a, b, failed], bin_s=0.1)
    assert edges == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert rate == pytest.approx([10.0, 30.0, 0.0, 20.0])
    edges, rate = output_throughput_over_time([failed], bin_s=0.1)
    assert len(edges) == 1 and len(rate) == 0


def test_arrivals_all_at_once_for_infinite_rate():
    assert np.array_equal(arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_have_the_requested_mean_and_burstiness(burstiness):
    rate, n = 20.0, 40_000
    offsets = arrival_offsets(n, rate, burstiness, np.random.default_rng(1234))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # A gamma with shape b has squared coefficient of variation 1/b (1 for Poisson's exponential gaps).
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.06)


def test_arrivals_are_reproducible_from_the_seed():
    first = arrival_offsets(50, 3.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(first, arrival_offsets(50, 3.0, 1.0, np.random.default_rng(7)))
    assert not np.array_equal(first, arrival_offsets(50, 3.0, 1.0, np.random.default_rng(8)))
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, np.random.default_rng(0))


def test_random_prompts_respect_lengths_and_vocab():
    prompts = datasets.random_prompts(np.random.default_rng(3), 200, vocab_size=50, input_len=40, output_len=10,
                                      range_ratio=0.5)
    assert all(20 <= p.num_prompt_tokens <= 60 and 5 <= p.max_tokens <= 15 for p in prompts)
    assert all(p.ignore_eos and max(p.token_ids) < 50 and min(p.token_ids) >= 0 for p in prompts)
    assert len({p.num_prompt_tokens for p in prompts}) > 10
    again = datasets.random_prompts(np.random.default_rng(3), 200, vocab_size=50, input_len=40, output_len=10,
                                    range_ratio=0.5)
    assert again == prompts
    fixed = datasets.random_prompts(np.random.default_rng(3), 20, vocab_size=50, input_len=7, output_len=3,
                                    range_ratio=0.0)
    assert {(p.num_prompt_tokens, p.max_tokens) for p in fixed} == {(7, 3)}


def test_shared_prefix_prompts_share_one_prefix_per_group():
    prompts = datasets.shared_prefix_prompts(np.random.default_rng(5), 12, vocab_size=1000, num_groups=3,
                                             prefix_len=32, input_len=8, output_len=4, range_ratio=0.0)
    prefixes = [p.token_ids[:32] for p in prompts]
    for i, prefix in enumerate(prefixes):
        assert prefix == prefixes[i % 3]
        assert len(prompts[i].token_ids) == 40 and prompts[i].max_tokens == 4
    assert len(set(prefixes)) == 3
    assert len({p.token_ids[32:] for p in prompts}) == 12


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello", "max_tokens": 5}) + "\n\n" + json.dumps({"prompt": "world"}) + "\n")
    prompts = datasets.jsonl_prompts(np.random.default_rng(0), 5, path, default_max_tokens=9, ignore_eos=False)
    assert len(prompts) == 5
    assert {(p.text, p.max_tokens) for p in prompts} == {("hello", 5), ("world", 9)}
    assert all(p.token_ids is None and p.num_prompt_tokens is None for p in prompts)
    for bad in ('{"text": "x"}', "not json", '{"prompt": "x", "max_tokens": 0}', '{"prompt": 3}'):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="prompts.jsonl:1"):
            datasets.jsonl_prompts(np.random.default_rng(0), 1, path, default_max_tokens=9, ignore_eos=False)


def test_requests_in_flight_is_a_step_function_over_every_ended_request():
    records = [make_record([(0.5, 1)], 2.0, start_s=0.0), make_record([(0.2, 1)], 1.0, start_s=1.0),
               make_record([], 0.5, start_s=2.0, status="UNAVAILABLE"), make_record([], None, start_s=3.0)]
    times, counts = requests_in_flight(records)
    # The second request ends (at 2.0) together with the first; the failed one still counts while it ran;
    # the one with no end is left out. An end sorts before a start at the same instant.
    assert times.tolist() == [0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.5]
    assert counts.tolist() == [0, 1, 2, 1, 0, 1, 0]


def test_plots_keep_their_axes_on_the_data_whatever_the_slo():
    """An SLO far beyond the data is named at the edge instead of stretching the axis; one inside
    is drawn as a line; count axes tick at whole numbers."""
    from tools.loadtest import report

    plt = report._pyplot()
    fig, (far, near) = plt.subplots(1, 2)
    samples = [0.010 + 0.001 * i for i in range(50)]         # 10..59 ms
    stats = LatencyStats.of(samples)
    report._latency_histogram(far, "TTFT", samples, stats, slo_ms=5000.0)
    report._latency_histogram(near, "TTFT", samples, stats, slo_ms=40.0)
    fig.canvas.draw()
    assert far.get_xlim()[1] < 100
    assert "SLO 5000 ms (beyond the axis)" in [t.get_text() for t in far.get_legend().get_texts()]
    assert any(list(line.get_xdata()) == [40.0, 40.0] for line in near.get_lines())
    assert all(float(tick).is_integer() for tick in far.get_yticks())
    plt.close(fig)
