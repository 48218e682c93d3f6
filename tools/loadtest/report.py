"""What a load test prints and writes: summary tables, the JSON file and the plots."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

from tools.loadtest.metrics import LatencyStats, RunResult, RunSummary, output_throughput_over_time

_LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2el"))
_WIDTH = 64


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_summary(summary: RunSummary, title: str) -> str:
    failures = ", ".join(f"{code} {n}" for code, n in summary.failed_by_code.items())
    slos = " ".join(f"{name}:{limit:g}" for name, limit in summary.slos_ms.items())
    hit_rate = None if summary.prefix_cache_hit_rate is None else 100 * summary.prefix_cache_hit_rate
    rows = [
        ("Request rate (req/s)", _rate(summary.request_rate)),
        ("Completed requests", str(summary.completed)),
        ("Failed requests", f"{summary.failed}" + (f" ({failures})" if failures else "")),
        ("Duration (s)", f"{summary.duration_s:.2f}"),
        ("Request throughput (req/s)", f"{summary.request_throughput:.2f}"),
        (f"Goodput (req/s) [{slos or 'no SLOs'}]", _opt(summary.goodput, ".2f")),
        ("Output token throughput (tok/s)", f"{summary.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{summary.total_token_throughput:.2f}"),
        ("Prompt / output tokens", f"{summary.total_prompt_tokens} / {summary.total_output_tokens}"),
        ("Prefix-cache hit rate", _opt(hit_rate, ".1f") + ("%" if hit_rate is not None else "")),
    ]
    lines = [f" {title} ".center(_WIDTH, "=")]
    lines += [f"{label + ':':<40}{value:>24}" for label, value in rows]
    lines.append(" Latency (ms) ".center(_WIDTH, "-"))
    lines.append(f"{'':<8}{'mean':>11}{'median':>11}{'p90':>11}{'p99':>11}{'max':>11}")
    for label, name in _LATENCIES:
        stats: LatencyStats | None = getattr(summary, name)
        values = (None,) * 5 if stats is None else (stats.mean_ms, stats.median_ms, stats.p90_ms, stats.p99_ms, stats.max_ms)
        lines.append(f"{label:<8}" + "".join(f"{_opt(v, '.2f'):>11}" for v in values))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def format_sweep_table(summaries: list[RunSummary]) -> str:
    """One row per request rate: throughput against median and p99 latencies (ms)."""
    header = ["rate", "done", "failed", "req/s", "out tok/s", "goodput"]
    for label, _ in _LATENCIES:
        header += [f"{label} p50", f"{label} p99"]
    rows = []
    for s in summaries:
        row = [_rate(s.request_rate), str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
               f"{s.output_throughput:.1f}", _opt(s.goodput, ".2f")]
        for _, name in _LATENCIES:
            stats = getattr(s, name)
            row += [_opt(stats and stats.median_ms, ".1f"), _opt(stats and stats.p99_ms, ".1f")]
        rows.append(row)
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def render(cells: list[str]) -> str:
        return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths))

    return "\n".join([render(header), render(["-" * w for w in widths]), *map(render, rows)])


def _json_safe(value):
    """JSON has no infinity; a rate of inf is written as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: pathlib.Path, settings: dict, results: list[RunResult], summaries: list[RunSummary]) -> None:
    """Settings, then per run: its summary and every request's record."""
    runs = [
        {"summary": dataclasses.asdict(summary), "requests": [r.to_json() for r in result.records]}
        for result, summary in zip(results, summaries)
    ]
    path.write_text(json.dumps(_json_safe({"settings": settings, "runs": runs}), indent=1))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def plot_run(path: pathlib.Path, result: RunResult, summary: RunSummary) -> None:
    """Histograms of TTFT, TPOT, ITL and E2E, and output throughput over the run."""
    plt = _pyplot()
    done = [r for r in result.records if r.ok]
    samples = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itls_s],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    fig = plt.figure(figsize=(12, 10), layout="constrained")
    grid = fig.add_gridspec(3, 2)
    for i, (label, name) in enumerate(_LATENCIES):
        ax = fig.add_subplot(grid[i // 2, i % 2])
        stats: LatencyStats | None = getattr(summary, name)
        if stats is not None:
            ms = [v * 1000 for v in samples[name]]
            # Explicit edges: numpy cannot split a range of float noise (all samples equal) into bins.
            edges = np.linspace(min(ms), max(max(ms), min(ms) + 1e-3), 41)
            ax.hist(ms, bins=edges, color="tab:blue", alpha=0.8)
            ax.axvline(stats.median_ms, color="black", linestyle="--", label=f"median {stats.median_ms:.1f}")
            ax.axvline(stats.p99_ms, color="tab:red", linestyle=":", label=f"p99 {stats.p99_ms:.1f}")
            ax.legend()
        ax.set(title=f"{label} ({len(samples[name])} samples)", xlabel="ms", ylabel="count")
    ax = fig.add_subplot(grid[2, :])
    # Per-second buckets as vLLM uses, finer when the run is too short to show a shape.
    bin_s = min(1.0, max(result.duration_s, 1e-3) / 50)
    edges, tokens_per_s = output_throughput_over_time(result.records, bin_s)
    ax.stairs(tokens_per_s, edges)
    ax.set_xlim(0.0, max(result.duration_s, edges[-1]))
    ax.set(title=f"Output throughput over time ({bin_s:.3g} s bins)", xlabel="s since start", ylabel="tokens/s")
    fig.suptitle(
        f"rate {_rate(summary.request_rate)} req/s: {summary.completed} completed, {summary.failed} failed, "
        f"{summary.output_throughput:.1f} output tok/s"
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(path: pathlib.Path, summaries: list[RunSummary]) -> None:
    """Median and p99 of each latency against output throughput, one point per request rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), layout="constrained")
    for ax, (label, name) in zip(axes.flat, _LATENCIES):
        points = [(s.output_throughput, getattr(s, name), s.request_rate) for s in summaries if getattr(s, name)]
        x = [p[0] for p in points]
        ax.plot(x, [p[1].median_ms for p in points], marker="o", label="median")
        ax.plot(x, [p[1].p99_ms for p in points], marker="s", linestyle="--", label="p99")
        for throughput, stats, rate in points:
            ax.annotate(_rate(rate), (throughput, stats.median_ms), textcoords="offset points", xytext=(4, 4))
        ax.set(title=f"{label} vs throughput (labels: req/s)", xlabel="output tokens/s", ylabel="ms")
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)
