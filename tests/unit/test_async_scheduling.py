"""The engine's step loop with a step in flight: it sends step N+1 before step N's reply is back
and gives every request the tokens, text and finish reason of the synchronous loop, through
preemptions, stop strings and a worker that dies with a step in flight. The engine core and a
frontend in one process, as with --frontends 0."""
from __future__ import annotations

import asyncio
import random

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models

from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.frontend.core_client import LocalCoreClient
from scheduler_svc.frontend.streams import Frontend
from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import FinishReason
from scheduler_svc.frontend.tokenizer import Tokenizer
from scheduler_svc.engine.worker_client import WorkerGroupClient
from tests.support.fake_worker import FakeWorkerClient

EOS = 0
VOCAB_SIZE = 6


def letter_tokenizer() -> Tokenizer:
    """Token i reads as the i-th letter, so stop strings can match across tokens."""
    rust = RustTokenizer(models.WordLevel({chr(ord("a") + i): i for i in range(VOCAB_SIZE)}, unk_token="a"))
    rust.decoder = decoders.Fuse()
    return Tokenizer(rust)


def random_requests(seed: int, num: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt = [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(1, 9))]
        stop = ("".join(rng.choice("abcdef") for _ in range(2)),) if rng.random() < 0.4 else ()
        requests.append((prompt, SamplingParams(max_tokens=rng.randint(1, 8), stop=stop,
                                                ignore_eos=rng.random() < 0.5)))
    return requests


async def generate(requests, client: FakeWorkerClient, async_scheduling: bool):
    """Every request's (token ids, text, finish reason), all submitted at once."""
    core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[EOS],
                      config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, reconnect_interval_s=0.001,
                                          async_scheduling=async_scheduling))
    frontend = Frontend(LocalCoreClient(core), letter_tokenizer())
    events = asyncio.create_task(frontend.run())
    await core.start()
    assert await core.wait_ready(timeout_s=10)

    async def collect(stream):
        tokens, text = [], ""
        async for out in stream:
            tokens += out.token_ids
            text += out.text
        return tokens, text, out.finish_reason

    try:
        streams = [await frontend.submit(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
        return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), timeout=60)
    finally:
        await core.shutdown(grace_s=0)
        events.cancel()


def test_a_step_in_flight_gives_the_synchronous_outputs():
    requests = random_requests(seed=1, num=12)         # 12 blocks of 2 for 4 at a time: preemptions
    sync_client, async_client = FakeWorkerClient(), FakeWorkerClient()
    expected = asyncio.run(generate(requests, sync_client, async_scheduling=False))
    assert asyncio.run(generate(requests, async_client, async_scheduling=True)) == expected
    assert (sync_client.max_in_flight, async_client.max_in_flight) == (1, 2)
    reasons = {reason for _, _, reason in expected}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons


def test_a_worker_that_dies_with_a_step_in_flight_is_reset_and_the_outputs_hold():
    requests = random_requests(seed=2, num=8)
    expected = asyncio.run(generate(requests, FakeWorkerClient(), async_scheduling=False))
    client = FakeWorkerClient(die_at={3, 9})
    assert asyncio.run(generate(requests, client, async_scheduling=True)) == expected
    assert client.restarts == 2 and client.max_in_flight == 2
