"""Greedy outputs through the whole service (separate processes, gRPC) equal transformers'
generate() token for token, in runs that force chunked prefill, prefix-cache hits and preemption."""
from __future__ import annotations

import random

import pytest

from tests.support.client import generate, generate_many, model_info
from tests.support.hf_reference import hf_greedy

pytestmark = pytest.mark.timeout(300)


def _random_requests(rng: random.Random, n: int, min_len: int, max_len: int, shared_prefix: list[int] = ()) -> list[dict]:
    reqs = []
    for _ in range(n):
        prompt = list(shared_prefix) + [rng.randrange(3, 512) for _ in range(rng.randint(min_len, max_len))]
        reqs.append(dict(token_ids=prompt, temperature=0.0, ignore_eos=True, max_tokens=rng.randint(4, 20)))
    return reqs


def _check_against_hf(model_dir, requests, completions) -> None:
    for i, (req, got) in enumerate(zip(requests, completions)):
        want = hf_greedy(model_dir, req["token_ids"], req["max_tokens"])
        assert got.token_ids == want, f"request {i} (prompt {len(req['token_ids'])} tokens) diverged from transformers"
        assert got.usage.completion_tokens == req["max_tokens"]
        assert got.usage.prompt_tokens == len(req["token_ids"])


def test_chunked_prefill_matches_transformers(tiny_model_dir, launch_services):
    rng = random.Random(1)
    # A 48-token step budget: the 100+-token prompts are computed in chunks, mixed with decodes.
    requests = _random_requests(rng, 14, 5, 60) + _random_requests(rng, 4, 100, 150)
    rng.shuffle(requests)
    with launch_services(scheduler_args=("--max-num-batched-tokens", "48")) as svc, svc.channel() as ch:
        completions = generate_many(ch, requests)
    _check_against_hf(tiny_model_dir, requests, completions)


def test_prefix_cache_hits_match_transformers(tiny_model_dir, services):
    rng = random.Random(2)
    prefix = [rng.randrange(3, 512) for _ in range(70)]   # 4 full blocks of 16, then a partial one
    first = _random_requests(rng, 1, 10, 20, prefix)
    sharing = _random_requests(rng, 16, 3, 40, prefix)
    with services.channel() as ch:     # the session's services: default flags, a prefix no other test sends
        warm = generate_many(ch, first)
        shared = generate_many(ch, sharing)
        repeat = generate(ch, **first[0])          # exactly an earlier prompt
        info = model_info(ch)
    _check_against_hf(tiny_model_dir, first + sharing + first, warm + shared + [repeat])
    assert all(c.usage.cached_prompt_tokens >= 64 for c in shared), [c.usage.cached_prompt_tokens for c in shared]
    # The repeat hits every full block but the one holding its last prompt token.
    assert repeat.usage.cached_prompt_tokens == (len(first[0]["token_ids"]) - 1) // 16 * 16
    assert info.worker_groups[0].prefix_cache_hit_tokens > 0


def test_preemption_matches_transformers(tiny_model_dir, launch_services):
    rng = random.Random(3)
    requests = _random_requests(rng, 20, 20, 90)
    # 24 blocks x 16 tokens: far less than the ~2000 tokens the 20 requests need at once. Each step its
    # own Step call here (the other tests send them over the Steps stream, the default).
    with launch_services(worker_args=("--num-kv-blocks", "24"), scheduler_args=("--no-step-stream",)) as svc, \
            svc.channel() as ch:
        completions = generate_many(ch, requests)
        info = model_info(ch)
        assert info.worker_groups[0].num_free_kv_blocks == 24
    assert info.worker_groups[0].num_preemptions > 0
    _check_against_hf(tiny_model_dir, requests, completions)
