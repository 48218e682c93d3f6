"""Data parallelism: one scheduler over two single-worker groups (`--workers A,B`). Concurrent
requests spread over both groups; requests sharing a prompt prefix follow the group that holds
it; greedy outputs equal one worker's."""
from __future__ import annotations

import random

import pytest

from tools.offline import LLM
from common.sampling import SamplingParams
from tests.support.client import generate, generate_many, model_info

pytestmark = pytest.mark.timeout(240)


def _request(rng: random.Random, prefix: list[int], min_len: int, max_len: int) -> dict:
    prompt = prefix + [rng.randrange(3, 512) for _ in range(rng.randint(min_len, max_len))]
    return dict(token_ids=prompt, temperature=0.0, ignore_eos=True, max_tokens=rng.randint(4, 12))


def _counters(info) -> list[tuple[int, int]]:
    return [(g.prefix_cache_queried_tokens, g.prefix_cache_hit_tokens) for g in info.worker_groups]


def test_two_groups_share_the_load_and_follow_cached_prefixes(tiny_model_dir, launch_services):
    rng = random.Random(7)
    spread = [_request(rng, [], 5, 60) for _ in range(16)]
    prefix = [rng.randrange(3, 512) for _ in range(40)]           # two full blocks of 16, and a part
    warm = _request(rng, prefix, 3, 10)
    sharing = [_request(rng, prefix, 3, 20) for _ in range(8)]
    with launch_services(num_workers=2) as svc, svc.channel() as channel:
        spread_out = generate_many(channel, spread)
        after_spread = _counters(model_info(channel))
        warm_out = generate(channel, **warm)
        after_warm = _counters(model_info(channel))
        sharing_out = generate_many(channel, sharing)
        info = model_info(channel)

    assert [(g.tensor_parallel_size, len(g.addresses)) for g in info.worker_groups] == [(1, 1), (1, 1)]
    assert all(queried > 0 for queried, _ in after_spread), after_spread   # both groups took requests
    # The warm request went to one group (it looked up its prompt there); the others follow it.
    [holder] = [i for i in (0, 1) if after_warm[i][0] > after_spread[i][0]]
    other = 1 - holder
    after_sharing = _counters(info)
    assert after_sharing[holder][1] - after_warm[holder][1] == 32 * len(sharing)
    assert after_sharing[other] == after_warm[other]
    assert all(c.usage.cached_prompt_tokens == 32 for c in sharing_out)

    requests = spread + [warm] + sharing
    single = LLM(str(tiny_model_dir)).generate(
        [r["token_ids"] for r in requests],
        [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"]) for r in requests])
    assert [c.token_ids for c in spread_out + [warm_out] + sharing_out] == single
