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
    slo_attainment,
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


def _integer_ticks(axis) -> None:
    """Counts (requests, samples) get whole-number ticks only."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


_SLO_COLOR = "tab:green"
_SLO_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E", "all": "all SLOs"}


def _mark_slo(ax, limit: float, *, vertical: bool) -> None:
    """Draws the SLO as a line when it lies within half again of the axis the data set (the axis
    grows to show it); one far beyond the data would squeeze the data into a corner, so it only
    gets a legend entry saying so. Call before the legend."""
    high = (ax.get_xlim() if vertical else ax.get_ylim())[1]
    if limit <= 1.5 * high:
        (ax.axvline if vertical else ax.axhline)(limit, color=_SLO_COLOR, linewidth=2, label=f"SLO {limit:g}")
        if limit >= high:   # set limits stop autoscaling: make room for the line by hand
            (ax.set_xlim(right=1.05 * limit) if vertical else ax.set_ylim(top=1.05 * limit))
    else:
        ax.plot([], [], color=_SLO_COLOR, linewidth=2, label=f"SLO {limit:g} ms (beyond the axis)")


def _latency_histogram(ax, label: str, samples_s: list[float], stats: LatencyStats | None,
                       slo_ms: float | None) -> None:
    title = f"{label} ({len(samples_s)} samples)"
    if stats is not None:
        ms = np.asarray(samples_s) * 1000
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
        if slo_ms is not None:   # the --goodput limit, so the picture shows who met it
            _mark_slo(ax, slo_ms, vertical=True)
        ax.legend(loc="best")
    _integer_ticks(ax.yaxis)
    ax.set(title=title, xlabel="ms", ylabel="requests" if label != "ITL" else "gaps")


def _slo_attainment_panel(ax, result: RunResult, summary: RunSummary) -> None:
    """One bar per SLO: the share of requests that met it, and of those that met all (goodput)."""
    shares = slo_attainment(result.records, summary.slos_ms)
    names = list(shares)
    bars = ax.barh([_SLO_LABELS[n] + (f" \u2264 {summary.slos_ms[n]:g} ms" if n in summary.slos_ms else "")
                    for n in names], [100 * shares[n] for n in names],
                   color=[_SLO_COLOR if n != "all" else "tab:purple" for n in names])
    ax.bar_label(bars, labels=[f"{100 * shares[n]:.0f}%" for n in names], padding=3)
    ax.invert_yaxis()
    ax.set_xlim(0, 110)
    ax.set(title=f"SLO attainment over {len(result.records)} requests (failed ones miss): "
                 f"goodput {_opt(summary.goodput, '.2f')} req/s", xlabel="% of requests")


def plot_run(path: pathlib.Path, result: RunResult, summary: RunSummary) -> None:
    """Histograms of TTFT, TPOT, ITL and E2E (each --goodput SLO on its own), SLO attainment when
    there are SLOs, and output throughput and requests in flight over the run."""
    plt = _pyplot()
    done = [r for r in result.records if r.ok]
    samples = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itls_s],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    rows = 4 if summary.slos_ms else 3
    fig = plt.figure(figsize=(12, 3.4 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, 2, height_ratios=[1, 1, 0.6, 1] if summary.slos_ms else [1, 1, 1])
    for i, (label, name) in enumerate(_LATENCIES):
        _latency_histogram(fig.add_subplot(grid[i // 2, i % 2]), label, samples[name], getattr(summary, name),
                           summary.slos_ms.get(name))
    if summary.slos_ms:
        _slo_attainment_panel(fig.add_subplot(grid[2, :]), result, summary)
    ax = fig.add_subplot(grid[rows - 1, :])
    # About 30 bins: batched decoding emits a token for every running request at once, so bins
    # only a step or two wide would show the step rhythm rather than the run's shape.
    bin_s = max(result.duration_s, 1e-3) / 30
    edges, tokens_per_s = output_throughput_over_time(result.records, bin_s)
    ax.stairs(tokens_per_s, edges, color="tab:blue", linewidth=1.5)
    ax.set_xlim(0.0, max(result.duration_s, edges[-1]))
    ax.set_ylim(bottom=0)
    ax.set_title(f"Output throughput ({bin_s:.2g} s bins) and requests in flight")
    ax.set_xlabel("s since start")
    # In flight on a second axis: it tells a server keeping up (flat) from a queue growing (rising).
    # Each axis is coloured as its line, which reads more easily than a legend over the data.
    in_flight_ax = ax.twinx()
    times, in_flight = requests_in_flight(result.records)
    in_flight_ax.step(times, in_flight, where="post", color="tab:orange")
    in_flight_ax.set_ylim(bottom=0)
    _integer_ticks(in_flight_ax.yaxis)
    for axis, color, label in ((ax, "tab:blue", "output tokens/s"), (in_flight_ax, "tab:orange", "requests in flight")):
        axis.set_ylabel(label, color=color)
        axis.tick_params(axis="y", colors=color)
    fig.suptitle(
        f"rate {_rate(summary.request_rate)} req/s: {summary.completed} completed, {summary.failed} failed, "
        f"{summary.output_throughput:.1f} output tok/s"
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _percentile_lines(ax, x, stats: list[LatencyStats | None]) -> None:
    keep = [(xi, s) for xi, s in zip(x, stats) if s is not None]
    ax.plot([k[0] for k in keep], [k[1].median_ms for k in keep], marker="o", label="p50")
    ax.plot([k[0] for k in keep], [k[1].p99_ms for k in keep], marker="s", linestyle="--", label="p99")


def plot_sweep(path: pathlib.Path, summaries: list[RunSummary]) -> None:
    """One point per request rate of the sweep: throughput (and goodput) against the rate, p50 and
    p99 TTFT and TPOT against the rate, and the same latencies against the throughput reached.
    Rates sit evenly spaced in the order run, so `inf` has a place of its own."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 2, figsize=(12, 12), layout="constrained")
    positions = list(range(len(summaries)))
    labels = [_rate(s.request_rate) for s in summaries]
    slos = summaries[0].slos_ms

    def rate_axis(ax, title: str, ylabel: str) -> None:
        ax.set_xticks(positions, labels)
        ax.set(title=title, xlabel="request rate (req/s)", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)

    ax = axes[0, 0]
    ax.plot(positions, [s.output_throughput for s in summaries], marker="o", color="tab:blue")
    rate_axis(ax, "Output token throughput", "output tokens/s")
    ax = axes[0, 1]
    ax.plot(positions, [s.request_throughput for s in summaries], marker="o", label="completed")
    if slos:   # goodput shares the unit of request throughput: its own line on the same axis
        ax.plot(positions, [s.goodput or 0.0 for s in summaries], marker="D", color="tab:purple",
                label="goodput (" + " ".join(f"{_SLO_LABELS[n]}\u2264{v:g}" for n, v in slos.items()) + " ms)")
    rate_axis(ax, "Request throughput", "requests/s")
    ax.legend()
    for column, (label, name) in enumerate((("TTFT", "ttft"), ("TPOT", "tpot"))):
        ax = axes[1, column]
        _percentile_lines(ax, positions, [getattr(s, name) for s in summaries])
        rate_axis(ax, f"{label} against the request rate", "ms")
        if name in slos:
            _mark_slo(ax, slos[name], vertical=False)
        ax.legend(loc="upper left")
        ax = axes[2, column]
        throughput = [s.output_throughput for s in summaries]
        _percentile_lines(ax, throughput, [getattr(s, name) for s in summaries])
        for x, s in zip(throughput, summaries):
            if getattr(s, name) is not None:
                ax.annotate(_rate(s.request_rate), (x, getattr(s, name).median_ms), textcoords="offset points",
                            xytext=(4, 4))
        ax.set(title=f"{label} against throughput (labels: req/s)", xlabel="output tokens/s", ylabel="ms")
        ax.set_ylim(bottom=0)
        ax.margins(x=0.08)  # room for the last point's label
        if name in slos:
            _mark_slo(ax, slos[name], vertical=False)
        ax.legend(loc="upper left")
    fig.suptitle(f"Request-rate sweep, {summaries[0].completed + summaries[0].failed} requests per rate")
    fig.savefig(path, dpi=100)
    plt.close(fig)
