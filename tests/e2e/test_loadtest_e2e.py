"""The load test against the real scheduler and worker processes on the tiny model."""
from __future__ import annotations

import json

import pytest

from tools.loadtest.__main__ import main


@pytest.fixture
def scheduler_addr(request) -> str:
    try:
        services = request.getfixturevalue("services")
    except pytest.FixtureLookupError:
        pytest.skip("needs the `services` fixture from tests/conftest.py")
    return services.scheduler_addr


def run_json(tmp_path, target: str, *args: str) -> dict:
    path = tmp_path / "run.json"
    assert main(["--target", target, "--seed", "3", "--disable-tqdm", "--timeout", "240",
                 "--save-json", str(path), *args]) == 0
    return json.loads(path.read_text())


def test_random_dataset_completes_with_exact_lengths(tmp_path, scheduler_addr):
    saved = run_json(tmp_path, scheduler_addr, "--num-prompts", "6", "--input-len", "12", "--output-len", "6",
                     "--range-ratio", "0.5", "--request-rate", "20", "--num-warmups", "1")
    summary, requests = saved["runs"][0]["summary"], saved["runs"][0]["requests"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    for r in requests:
        assert r["status"] == "OK"
        assert r["output_tokens"] == r["requested_tokens"]  # ignore_eos and max_tokens hold the length
        assert 6 <= r["prompt_tokens"] <= 18
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert all(gap > 0 for gap in r["itls_s"]) and r["tpot_s"] > 0
    assert summary["output_throughput"] > 0 and summary["ttft"]["max_ms"] > 0


def test_shared_prefix_dataset_hits_the_prefix_cache(tmp_path, scheduler_addr):
    info = run_json(tmp_path, scheduler_addr, "--num-prompts", "1", "--input-len", "4", "--output-len", "2")
    block_size = info["settings"]["server"]["block_size"]
    # One request at a time, so every later prompt of a group finds its prefix's blocks cached.
    saved = run_json(tmp_path, scheduler_addr, "--dataset", "shared-prefix", "--prefix-groups", "2",
                     "--prefix-len", str(2 * block_size), "--input-len", "4", "--output-len", "3",
                     "--num-prompts", "6", "--max-concurrency", "1")
    summary = saved["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert all(r["output_tokens"] == 3 for r in saved["runs"][0]["requests"])
    assert summary["prefix_cache_hit_rate"] > 0


def test_json_schema_and_chat_workloads(tmp_path, scheduler_addr):
    saved = run_json(tmp_path, scheduler_addr, "--num-prompts", "8", "--input-len", "8", "--output-len", "40",
                     "--json-schema-ratio", "0.5")
    summary = saved["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert saved["settings"]["json_schema_ratio"] == 0.5 and json.loads(saved["settings"]["json_schema"])
    tool = json.dumps({"name": "lookup", "parameters": {"type": "object", "properties": {
        "key": {"type": "string", "maxLength": 8}}, "required": ["key"]}})
    chat = run_json(tmp_path, scheduler_addr, "--api", "chat", "--num-prompts", "4", "--input-len", "8",
                    "--output-len", "30", "--tool", tool, "--tool-choice", "required")
    summary = chat["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (4, 0)
    # The chat template wraps each 8-token prompt (and the tool's description) in its turn markers.
    assert all(r["prompt_tokens"] > 30 and r["output_tokens"] == 30 for r in chat["runs"][0]["requests"])
