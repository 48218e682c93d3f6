"""Prometheus metrics of the scheduler, served over HTTP by prometheus-client.

Gauges that describe current state (queue lengths, KV blocks, worker health) are read from the
engine core's state snapshot when Prometheus scrapes, so the step loop only pays for the counters
and histograms.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineStateCollector:
    """Gauges from one snapshot of the engine core's state (EngineCore.info(), which GetModelInfo
    reads too), taken when Prometheus scrapes."""

    def __init__(self, snapshot) -> None:
        self.snapshot = snapshot

    def collect(self):
        running = GaugeMetricFamily("llm_requests_running", "Requests being computed", labels=["group"])
        waiting = GaugeMetricFamily("llm_requests_waiting", "Requests queued (incl. preempted)", labels=["group"])
        paused = GaugeMetricFamily("llm_requests_paused", "Requests out of the batch until their clients read "
                                   "again (backpressure)", labels=["group"])
        used = GaugeMetricFamily("llm_kv_blocks_used", "KV-cache blocks in use", labels=["group"])
        free = GaugeMetricFamily("llm_kv_blocks_free", "KV-cache blocks free", labels=["group"])
        healthy = GaugeMetricFamily("llm_worker_group_healthy", "1 when the group answers steps", labels=["group", "addresses"])
        hit_rate = GaugeMetricFamily("llm_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up", labels=["group"])
        tp_size = GaugeMetricFamily("llm_worker_group_tensor_parallel_size", "Ranks (worker processes) of the group", labels=["group"])
        for index, g in enumerate(self.snapshot().groups):
            label = str(index)
            healthy.add_metric([label, ",".join(g.addresses)], 1.0 if g.healthy else 0.0)
            tp_size.add_metric([label], len(g.addresses))
            if not g.num_kv_blocks:          # never connected: no scheduler state yet
                continue
            running.add_metric([label], g.num_running)
            waiting.add_metric([label], g.num_waiting)
            paused.add_metric([label], g.num_paused)
            free.add_metric([label], g.num_free_kv_blocks)
            used.add_metric([label], g.num_kv_blocks - g.num_free_kv_blocks)
            queried, hits = g.prefix_cache_queried_tokens, g.prefix_cache_hit_tokens
            hit_rate.add_metric([label], hits / queried if queried else 0.0)
        yield from (running, waiting, paused, used, free, healthy, hit_rate, tp_size)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram("llm_step_seconds", "Wall time of one engine step, scheduler to worker and back",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.worker_forward_seconds = Histogram("llm_worker_forward_seconds", "Worker-reported device time of a step (host time launching it on the CPU)",
                                                buckets=_LATENCY_BUCKETS, registry=r)
        self.step_tokens = Histogram("llm_step_tokens", "Tokens computed in one step",
                                     buckets=(1, 8, 32, 128, 512, 2048, 8192), registry=r)
        self.ttft_seconds = Histogram("llm_time_to_first_token_seconds", "Arrival to first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot_seconds = Histogram("llm_time_per_output_token_seconds", "Mean time between output tokens of a request",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_seconds = Histogram("llm_request_duration_seconds", "Arrival to the last token",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("llm_requests_finished", "Finished requests", ["reason"], registry=r)
        self.rejected = Counter("llm_requests_rejected", "Requests refused before admission", ["code"], registry=r)
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("llm_generated_tokens", "Output tokens of finished requests", registry=r)
        self.sampled_tokens = Counter("llm_sampled_tokens", "Output tokens as each step brings them (requests in "
                                      "flight included; a recomputed request's tokens count once)", registry=r)
        # Speculative decoding; mean acceptance length = 1 + accepted / verifications.
        self.spec_verifications = Counter("llm_spec_decode_verifications", "Decodes that verified draft tokens",
                                          registry=r)
        self.spec_draft_tokens = Counter("llm_spec_decode_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("llm_spec_decode_accepted_tokens", "Draft tokens accepted (output "
                                            "tokens beyond the one each verification brings anyway)", registry=r)
        self.worker_failures = Counter("llm_worker_failures", "Steps that failed because a worker was down", ["group"], registry=r)

    def watch(self, snapshot) -> None:
        """Reads the state gauges from snapshot() (a CoreInfo) at each scrape."""
        self.registry.register(_EngineStateCollector(snapshot))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    # -- hooks the engine calls ---------------------------------------------------------
    def observe_step(self, num_tokens: int, step_ms: float, worker_forward_ms: float) -> None:
        self.step_seconds.observe(step_ms / 1000)
        self.worker_forward_seconds.observe(worker_forward_ms / 1000)
        self.step_tokens.observe(num_tokens)

    def observe_request(self, reason: str, arrival: float, first_token_at: float | None,
                        num_prompt_tokens: int, num_output_tokens: int) -> None:
        now = time.monotonic()
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generated_tokens.inc(num_output_tokens)
        self.e2e_seconds.observe(now - arrival)
        if first_token_at is not None:
            self.ttft_seconds.observe(first_token_at - arrival)
            if num_output_tokens > 1:
                self.tpot_seconds.observe((now - first_token_at) / (num_output_tokens - 1))

    def observe_sampled(self, num_tokens: int) -> None:
        self.sampled_tokens.inc(num_tokens)

    def observe_spec_decode(self, num_verifications: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.spec_verifications.inc(num_verifications)
        self.spec_draft_tokens.inc(num_draft_tokens)
        self.spec_accepted_tokens.inc(num_accepted_tokens)

    def observe_rejection(self, code: str, count: int = 1) -> None:
        self.rejected.labels(code).inc(count)

    def observe_worker_failure(self, group: int) -> None:
        self.worker_failures.labels(str(group)).inc()
