"""What a load test prints and writes: summary tables, the JSON file and the plots."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

from tools.loadtest.metrics import (
    LatencyStats,
    RunResult,
    RunSummary,
    output_throughput_over_time,
    requests_in_flight,
)

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
    """Histograms of TTFT, TPOT, ITL and E2E (with their --goodput SLOs), and output throughput
    and requests in flight over the run."""
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
        title = f"{label} ({len(samples[name])} samples)"
        if stats is not None:
            ms = np.asarray(samples[name]) * 1000
            # A few stalls far out (a pause of the host, say) would squeeze the bulk into one or two
            # bins: the axis stops at twice the p99 and the title counts what lies beyond.
            upper = min(float(ms.max()), 2 * stats.p99_ms)
            beyond = int((ms > upper).sum())
            if beyond:
                title += f", {beyond} above {upper:.0f} ms not shown"
            # Explicit edges: numpy cannot split a range of float noise (all samples equal) into bins.
            edges = np.linspace(ms.min(), max(upper, ms.min() + 1e-3), 41)
            ax.hist(ms[ms <= upper], bins=edges, color="tab:blue", alpha=0.8)
            ax.axvline(stats.median_ms, color="black", linestyle="--", label=f"median {stats.median_ms:.1f}")
            ax.axvline(stats.p99_ms, color="tab:red", linestyle=":", label=f"p99 {stats.p99_ms:.1f}")
            if name in summary.slos_ms:  # the --goodput limit, so the picture shows who met it
                limit = summary.slos_ms[name]
                ax.axvline(limit, color="tab:green", linewidth=2, label=f"SLO {limit:g}")
            ax.legend()
        ax.set(title=title, xlabel="ms", ylabel="count")
    ax = fig.add_subplot(grid[2, :])
    # About 30 bins: batched decoding emits a token for every running request at once, so bins
    # only a step or two wide would show the step rhythm rather than the run's shape.
    bin_s = max(result.duration_s, 1e-3) / 30
    edges, tokens_per_s = output_throughput_over_time(result.records, bin_s)
    ax.stairs(tokens_per_s, edges, color="tab:blue", linewidth=1.5)
    ax.set_xlim(0.0, max(result.duration_s, edges[-1]))
    ax.set_title(f"Output throughput ({bin_s:.2g} s bins) and requests in flight")
    ax.set_xlabel("s since start")
    # In flight on a second axis: it tells a server keeping up (flat) from a queue growing (rising).
    # Each axis is coloured as its line, which reads more easily than a legend over the data.
    in_flight_ax = ax.twinx()
    times, in_flight = requests_in_flight(result.records)
    in_flight_ax.step(times, in_flight, where="post", color="tab:orange")
    in_flight_ax.set_ylim(bottom=0)
    for axis, color, label in ((ax, "tab:blue", "output tokens/s"), (in_flight_ax, "tab:orange", "requests in flight")):
        axis.set_ylabel(label, color=color)
        axis.tick_params(axis="y", colors=color)
    fig.suptitle(
        f"rate {_rate(summary.request_rate)} req/s: {summary.completed} completed, {summary.failed} failed, "
        f"{summary.output_throughput:.1f} output tok/s"
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(path: pathlib.Path, summaries: list[RunSummary]) -> None:
    """Median and p99 of each latency (and its --goodput SLO) against output throughput, one point
    per request rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), layout="constrained")
    for ax, (label, name) in zip(axes.flat, _LATENCIES):
        points = [(s.output_throughput, getattr(s, name), s.request_rate) for s in summaries if getattr(s, name)]
        x = [p[0] for p in points]
        ax.plot(x, [p[1].median_ms for p in points], marker="o", label="median")
        ax.plot(x, [p[1].p99_ms for p in points], marker="s", linestyle="--", label="p99")
        for throughput, stats, rate in points:
            ax.annotate(_rate(rate), (throughput, stats.median_ms), textcoords="offset points", xytext=(4, 4))
        if name in summaries[0].slos_ms:
            ax.axhline(summaries[0].slos_ms[name], color="tab:green", linewidth=2, label="SLO")
        ax.set(title=f"{label} vs throughput (labels: req/s)", xlabel="output tokens/s", ylabel="ms")
        ax.set_ylim(bottom=0)
        ax.margins(x=0.08)  # room for the last point's label
        ax.legend()
    goodputs = ", ".join(f"{_rate(s.request_rate)}: {_opt(s.goodput, '.2f')}" for s in summaries)
    fig.suptitle(f"Request-rate sweep, {summaries[0].completed + summaries[0].failed} requests per rate"
                 + (f"; goodput (req/s) {goodputs}" if summaries[0].slos_ms else ""))
    fig.savefig(path, dpi=100)
    plt.close(fig)
