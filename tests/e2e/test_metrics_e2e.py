"""The scheduler's Prometheus endpoint reports queue, KV, prefix-cache, latency and worker health."""
from __future__ import annotations

import pytest

from tests.support.client import generate, generate_many
from tests.support.procs import free_port
from tools.loadtest.metrics import scrape_metrics

pytestmark = pytest.mark.timeout(300)


def test_metrics_endpoint(launch_services):
    port = free_port()
    prompt = list(range(3, 60))
    with launch_services(scheduler_args=("--metrics-port", str(port))) as svc, svc.channel() as ch:
        generate(ch, token_ids=prompt, max_tokens=4, ignore_eos=True)
        generate_many(ch, [dict(token_ids=prompt + [7, 8], max_tokens=6, ignore_eos=True)] * 3)
        m = scrape_metrics(port)
    assert m['llm_requests_finished_total{reason="length"}'] == 4
    assert m["llm_generated_tokens_total"] == 4 + 3 * 6
    assert m["llm_time_to_first_token_seconds_count"] == 4
    assert m["llm_time_per_output_token_seconds_count"] == 4
    assert m["llm_step_seconds_count"] > 0
    assert m['llm_requests_running{group="0"}'] == 0
    assert m['llm_kv_blocks_used{group="0"}'] == 0
    assert m['llm_prefix_cache_hit_rate{group="0"}'] > 0
    assert any(k.startswith("llm_worker_group_healthy") and v == 1.0 for k, v in m.items())
