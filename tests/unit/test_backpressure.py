"""Backpressure in one process (engine core, a frontend, a fake worker): a consumer that stops
reading has at most the window generated ahead of it, its request leaves the batch without
stalling the others, and once it reads again it gets the rest, token for token what an
uninterrupted run gives. Through real processes and gRPC: tests/test_backpressure_e2e.py."""
from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.engine.config import MOST_STEPS_IN_FLIGHT
from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.frontend.core_client import LocalCoreClient
from scheduler_svc.frontend.streams import Frontend
from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import FinishReason
from scheduler_svc.engine.worker_client import WorkerGroupClient
from tests.support.fake_worker import FakeWorkerClient
from tests.unit.test_async_scheduling import letter_tokenizer

WINDOW = 8
MAX_TOKENS = 60


async def _engine(window: int) -> tuple[EngineCore, Frontend, asyncio.Task]:
    client = FakeWorkerClient(num_blocks=128, block_size=4, step_s=0.001)
    core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[0], config=EngineConfig(max_num_seqs=8))
    frontend = Frontend(LocalCoreClient(core), letter_tokenizer(), stream_window=window)
    events = asyncio.create_task(frontend.run())
    await core.start()
    assert await core.wait_ready(timeout_s=10)
    return core, frontend, events


async def _read_all(stream) -> tuple[list[int], FinishReason]:
    tokens = []
    async for out in stream:
        tokens += out.token_ids
    return tokens, out.finish_reason


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def test_a_reader_that_stops_has_at_most_the_window_generated_then_gets_the_rest():
    async def scenario():
        core, frontend, events = await _engine(WINDOW)
        try:
            expected = await _read_all(await frontend.submit("ref", [1, 2, 3], _params()))
            sampled = core.metrics.sampled_tokens
            slow = await frontend.submit("slow", [1, 2, 3], _params())
            read = []
            async for out in slow:             # reads 3 messages, then stops reading
                read += out.token_ids
                if len(read) >= 3:
                    break
            await _until(lambda: core.info().groups[0].num_paused == 1)
            # Others run on meanwhile (the paused request does not stall the batch), and their
            # steps bring in whatever was in flight for it when it paused.
            other = await _read_all(await frontend.submit("other", [4, 5], _params()))
            assert other[1] == FinishReason.LENGTH and len(other[0]) == MAX_TOKENS
            generated = sampled._value.get() - 2 * MAX_TOKENS
            await asyncio.sleep(0.1)
            assert sampled._value.get() - 2 * MAX_TOKENS == generated, "the paused request kept generating"
            # Up to the window past what was read, plus what the other steps in flight bring (at most
            # MOST_STEPS_IN_FLIGHT in all while so few requests run).
            assert generated <= len(read) + WINDOW + MOST_STEPS_IN_FLIGHT - 1, generated
            assert core.info().groups[0].num_running == 0
            rest = await _read_all(slow)
            assert (read + rest[0], rest[1]) == expected
            assert core.info().groups[0].num_paused == 0
        finally:
            await core.shutdown(grace_s=0)
            events.cancel()

    asyncio.run(scenario())


def test_a_paused_request_is_aborted_when_its_reader_goes_away():
    async def scenario():
        core, frontend, events = await _engine(WINDOW)
        try:
            stream = await frontend.submit("gone", [1, 2, 3], _params())
            await stream.__anext__()
            await _until(lambda: core.info().groups[0].num_paused == 1)
            await stream.aclose()              # the client went away
            await _until(lambda: core.num_active == 0)
            group = core.info().groups[0]
            assert group.num_paused == 0 and group.num_free_kv_blocks == group.num_kv_blocks
        finally:
            await core.shutdown(grace_s=0)
            events.cancel()

    asyncio.run(scenario())


def test_without_a_window_a_reader_that_stops_is_generated_for_to_the_end():
    async def scenario():
        core, frontend, events = await _engine(0)
        try:
            stream = await frontend.submit("unbounded", [1, 2, 3], _params())
            await stream.__anext__()
            await _until(lambda: core.num_active == 0)
            assert core.metrics.sampled_tokens._value.get() == MAX_TOKENS
            await stream.aclose()
        finally:
            await core.shutdown(grace_s=0)
            events.cancel()

    asyncio.run(scenario())


@pytest.mark.parametrize("window, interval", [(1, 1), (3, 2)])
def test_a_window_smaller_than_two_messages_is_refused(window, interval):
    async def make():
        Frontend(LocalCoreClient(None), letter_tokenizer(), stream_interval=interval, stream_window=window)

    with pytest.raises(ValueError, match="at least twice stream_interval"):
        asyncio.run(make())
