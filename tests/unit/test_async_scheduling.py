"""The engine's step loop with steps in flight: it sends step N+1 (and, while the batch is small,
N+2) before step N's reply is back and gives every request the tokens, text and finish reason of
the synchronous loop, through preemptions, stop strings and a worker that dies with steps in
flight. The engine core and a frontend in one process, as with --frontends 0."""
from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models

from scheduler_svc.engine.block_manager import BlockManager
from scheduler_svc.engine.config import FOURTH_STEP_MAX_SEQS, MOST_STEPS_IN_FLIGHT
from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.engine.group_runner import GroupHooks, GroupRunner
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.sequence import Sequence
from scheduler_svc.engine.speculation import SpeculationConfig
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


async def generate(requests, client: FakeWorkerClient, async_scheduling: bool, third_step_max_seqs: int = 32,
                   fourth_step_max_seqs: int = 0):
    """Every request's (token ids, text, finish reason), all submitted at once."""
    core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[EOS],
                      config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, reconnect_interval_s=0.001,
                                          async_scheduling=async_scheduling, third_step_max_seqs=third_step_max_seqs,
                                          fourth_step_max_seqs=fourth_step_max_seqs))
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


@pytest.mark.parametrize("third_step_max_seqs, fourth_step_max_seqs, depth", [(0, 4, 2), (32, 0, 3), (32, 32, 4)])
def test_steps_in_flight_give_the_synchronous_outputs(third_step_max_seqs, fourth_step_max_seqs, depth):
    requests = random_requests(seed=1, num=12)         # 12 blocks of 2 for 4 at a time: preemptions
    sync_client, async_client = FakeWorkerClient(), FakeWorkerClient()
    expected = asyncio.run(generate(requests, sync_client, async_scheduling=False))
    assert asyncio.run(generate(requests, async_client, async_scheduling=True, third_step_max_seqs=third_step_max_seqs,
                                fourth_step_max_seqs=fourth_step_max_seqs)) == expected
    assert (sync_client.max_in_flight, async_client.max_in_flight) == (1, depth)
    reasons = {reason for _, _, reason in expected}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons


def test_a_third_and_fourth_step_only_while_few_requests_run_or_wait_and_none_speculates():
    def runner(async_scheduling=True, third_step_max_seqs=3, num_speculative_tokens=0, fourth_step_max_seqs=0
               ) -> GroupRunner:
        group = GroupRunner(0, WorkerGroupClient([FakeWorkerClient()]),
                            EngineConfig(async_scheduling=async_scheduling, third_step_max_seqs=third_step_max_seqs,
                                         fourth_step_max_seqs=fourth_step_max_seqs),
                            [EOS], SchedulerMetrics(), GroupHooks(lambda g: None, lambda *a: None, lambda g: None))
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=2,
                                 speculation=SpeculationConfig(num_speculative_tokens=num_speculative_tokens))
        group.scheduler = Scheduler(config, BlockManager(64, 2), eos_token_ids=[EOS])
        return group

    def add(group: GroupRunner, n: int) -> None:
        for _ in range(n):
            group.scheduler.add(Sequence(next(ids), "r", [1, 2, 3], SamplingParams(max_tokens=4)))

    def walk(group: GroupRunner, first: int, later: int) -> list[int]:
        """The depths idle, with `first` requests waiting, with them running, then as each of `later` more arrives."""
        seen = [group._depth()]
        add(group, first)
        seen.append(group._depth())
        group.scheduler.schedule()
        assert len(group.scheduler.running) == first
        seen.append(group._depth())
        for _ in range(later):
            add(group, 1)
            seen.append(group._depth())
        return seen

    ids = itertools.count(1)
    assert walk(runner(), 3, 1) == [3, 3, 3, 2]                               # third_step_max_seqs 3
    assert walk(runner(fourth_step_max_seqs=2), 2, 2) == [4, 4, 4, 3, 2]     # and a fourth up to 2
    assert runner(third_step_max_seqs=0)._depth() == 2
    assert runner(async_scheduling=False)._depth() == 1
    assert runner(num_speculative_tokens=2)._depth() == 2
    assert runner(fourth_step_max_seqs=8)._depth() == 4                      # (bounded by the third's 3)
    assert runner(third_step_max_seqs=0, fourth_step_max_seqs=8)._depth() == 2
    assert runner(num_speculative_tokens=2, fourth_step_max_seqs=8)._depth() == 2
    assert EngineConfig().fourth_step_max_seqs == FOURTH_STEP_MAX_SEQS and 4 == MOST_STEPS_IN_FLIGHT


@pytest.mark.parametrize("third_step_max_seqs, fourth_step_max_seqs, depth", [(0, 0, 2), (32, 0, 3), (32, 32, 4)])
def test_a_worker_that_dies_with_steps_in_flight_is_reset_and_the_outputs_hold(third_step_max_seqs,
                                                                               fourth_step_max_seqs, depth):
    requests = random_requests(seed=2, num=8)
    expected = asyncio.run(generate(requests, FakeWorkerClient(), async_scheduling=False))
    client = FakeWorkerClient(die_at={3, 9})
    assert asyncio.run(generate(requests, client, async_scheduling=True, third_step_max_seqs=third_step_max_seqs,
                                fourth_step_max_seqs=fourth_step_max_seqs)) == expected
    assert client.restarts == 2 and client.max_in_flight == depth


def test_a_step_loop_that_raises_is_restarted_and_the_outputs_hold(monkeypatch, caplog):
    """A bug in the step loop (here: its depth rule raising once, mid-run) is logged with its
    traceback; the group goes down, reconnects and re-sends its requests, which all finish as if
    nothing had happened."""
    requests = random_requests(seed=4, num=8)
    expected = asyncio.run(generate(requests, FakeWorkerClient(), async_scheduling=False))
    depth, calls = GroupRunner._depth, itertools.count()

    def fails_once(self):
        if next(calls) == 20:
            raise RuntimeError("a bug")
        return depth(self)

    monkeypatch.setattr(GroupRunner, "_depth", fails_once)
    assert asyncio.run(generate(requests, FakeWorkerClient(), async_scheduling=True)) == expected
    assert next(calls) > 21
    assert any("step loop failed (1 in a row)" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_step_loop_that_keeps_failing_is_restarted_less_and_less_often(monkeypatch):
    """Failures in a row wait twice as long each time (up to LOOP_RESTART_MAX_S): a bug that
    repeats does not spin; stop() cancels a restart still pending."""
    from scheduler_svc.engine import group_runner

    async def run() -> list[float]:
        delays = []
        group = GroupRunner(0, WorkerGroupClient([FakeWorkerClient()]), EngineConfig(reconnect_interval_s=0.5),
                            [EOS], SchedulerMetrics(), GroupHooks(lambda g: None, lambda *a: None, lambda g: None))
        loop = asyncio.get_running_loop()
        original = loop.call_later
        monkeypatch.setattr(loop, "call_later", lambda delay, fn: delays.append(delay) or original(3600, fn))

        async def fails():
            raise RuntimeError("a bug")

        for _ in range(8):
            task = asyncio.ensure_future(fails())
            await asyncio.gather(task, return_exceptions=True)
            group._loop_ended(task)
        await group.stop()
        assert group._restart.cancelled()
        return delays

    assert asyncio.run(run()) == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert group_runner.LOOP_RESTART_MAX_S == 30.0
