"""Per-request timing records and the run statistics vLLM's serving benchmark reports.

Definitions (as vLLM's `bench serve`):
- TTFT: from sending the request to the first stream message that carries tokens.
- ITL: the gap between consecutive token-carrying messages. A message carrying k > 1 tokens is one
  gap, not k: the client saw the tokens arrive together, and splitting the gap would invent
  arrival times it never observed. TPOT below still spreads the time over every token.
- TPOT: (E2E - TTFT) / (output_tokens - 1), for requests with more than one output token.
- E2E: from sending the request to the end of its stream.
- Goodput: completed requests per second whose TTFT, TPOT and E2E all meet the given SLOs
  (a one-token request's TPOT counts as 0, as vLLM counts it).

`scrape_metrics` reads the server's side: the scheduler's Prometheus samples.
"""
from __future__ import annotations

import urllib.request

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

OK = "OK"
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client observed of one request."""

    request_id: str
    start_s: float  # when it was sent, in seconds after the run started
    requested_tokens: int | None
    status: str = OK  # OK, else the gRPC status code name (ABORTED for a stream the server aborted)
    error: str = ""
    e2e_s: float | None = None
    # Arrival time (seconds after sending) and token count of every token-carrying message.
    message_times_s: list[float] = field(default_factory=list)
    message_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0

    def observe_message(self, elapsed_s: float, num_tokens: int) -> None:
        # Messages without tokens (a final usage-only message, say) are no token arrival.
        if num_tokens:
            self.message_times_s.append(elapsed_s)
            self.message_tokens.append(num_tokens)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def output_tokens(self) -> int:
        return sum(self.message_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.message_times_s[0] if self.message_times_s else None

    @property
    def itls_s(self) -> list[float]:
        times = self.message_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "status": self.status,
            "error": self.error,
            "start_s": self.start_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "itls_s": self.itls_s,
            "message_tokens": self.message_tokens,
            "requested_tokens": self.requested_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "output_tokens": self.output_tokens,
        }


@dataclass(frozen=True)
class RunResult:
    """One timed run at one request rate."""

    request_rate: float
    duration_s: float
    records: list[RequestRecord]


@dataclass(frozen=True)
class LatencyStats:
    """Summary of a latency distribution, in milliseconds (numpy's linear-interpolated percentiles)."""

    count: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, values_s: list[float]) -> LatencyStats | None:
        if not values_s:
            return None
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(len(ms), float(ms.mean()), float(p50), float(p90), float(p99), float(ms.max()))


def parse_slos(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}, in milliseconds."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {item!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"goodput SLO {item!r} must not be negative")
    return slos


def _observed_ms(record: RequestRecord) -> dict[str, float] | None:
    """A completed request's value of each SLO metric (None when it did not complete)."""
    if not record.ok or record.ttft_s is None or record.e2e_s is None:
        return None
    return {"ttft": record.ttft_s * 1000.0, "tpot": (record.tpot_s or 0.0) * 1000.0, "e2el": record.e2e_s * 1000.0}


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    observed = _observed_ms(record)
    return observed is not None and all(observed[name] <= limit for name, limit in slos_ms.items())


def slo_attainment(records: list[RequestRecord], slos_ms: dict[str, float]) -> dict[str, float]:
    """The share of all requests (failed ones count as misses) that met each SLO, and under "all"
    the share that met every one (goodput's numerator over the request count)."""
    if not records:
        return {}
    observed = [_observed_ms(r) for r in records]
    shares = {name: sum(o is not None and o[name] <= limit for o in observed) / len(records)
              for name, limit in slos_ms.items()}
    shares["all"] = sum(meets_slos(r, slos_ms) for r in records) / len(records)
    return shares


@dataclass(frozen=True)
class RunSummary:
    request_rate: float
    duration_s: float
    completed: int
    failed: int
    failed_by_code: dict[str, int]
    total_prompt_tokens: int
    total_output_tokens: int
    cached_prompt_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    prefix_cache_hit_rate: float | None  # None when the server reported no prompt tokens
    slos_ms: dict[str, float]
    goodput: float | None  # None when no SLOs were given
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2el: LatencyStats | None


def summarize(result: RunResult, slos_ms: dict[str, float]) -> RunSummary:
    """Run statistics over completed requests; failed ones are only counted, by status code."""
    done = [r for r in result.records if r.ok]
    duration = max(result.duration_s, 1e-9)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    cached_tokens = sum(r.cached_prompt_tokens for r in done)
    return RunSummary(
        request_rate=result.request_rate,
        duration_s=result.duration_s,
        completed=len(done),
        failed=len(result.records) - len(done),
        failed_by_code=dict(Counter(r.status for r in result.records if not r.ok).most_common()),
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        cached_prompt_tokens=cached_tokens,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(prompt_tokens + output_tokens) / duration,
        prefix_cache_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else None,
        slos_ms=dict(slos_ms),
        goodput=sum(meets_slos(r, slos_ms) for r in done) / duration if slos_ms else None,
        ttft=LatencyStats.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=LatencyStats.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=LatencyStats.of([gap for r in done for gap in r.itls_s]),
        e2el=LatencyStats.of([r.e2e_s for r in done if r.e2e_s is not None]),
    )


def output_throughput_over_time(records: list[RequestRecord], bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin edges in s since the run started, output tokens/s in each bin), from completed requests' messages."""
    times = [r.start_s + t for r in records if r.ok for t in r.message_times_s]
    tokens = [n for r in records if r.ok for n in r.message_tokens]
    if not times:
        return np.zeros(1), np.zeros(0)
    # Enough bins that the last arrival falls strictly inside the last one.
    edges = np.arange(int(max(times) / bin_s) + 2) * bin_s
    counts, _ = np.histogram(times, bins=edges, weights=tokens)
    return edges, counts / bin_s


def requests_in_flight(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(times in s since the run started, requests in flight from each time on): a step function
    over every finished request, failed ones included, since they held the server's attention too."""
    spans = [(r.start_s, r.start_s + r.e2e_s) for r in records if r.e2e_s is not None]
    if not spans:
        return np.zeros(1), np.zeros(1)
    # Tuples sort an end (-1) before a start (+1) at the same instant, so the count never overshoots.
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    times = np.array([0.0] + [t for t, _ in events])
    counts = np.concatenate([[0], np.cumsum([step for _, step in events])])
    return times, counts


def scrape_metrics(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """The scheduler's Prometheus samples on `port`, keyed as exposed: name{labels}."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}
