"""A worker group's step loop around what goes wrong with its workers: what it logs when one
restarts, how it claims, renews and loses a worker's lease, and how a request that makes the
worker fail is failed alone after a bounded number of tries. The engine core runs in this
process over fake worker clients (tests/support/fake_worker.py)."""
from __future__ import annotations

import asyncio
import logging

from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.engine.api import CoreRequest, make_seq_id
from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import FinishReason
from scheduler_svc.engine.worker_client import WorkerGroupClient
from tests.support.fake_worker import FakeWorkerClient


async def _run_to_completion(core: EngineCore, requests: list[CoreRequest], timeout_s: float = 30.0) -> dict:
    """Adds the requests through frontend 0 and returns {seq_id: (token ids, finish reason)}."""
    queue = core.attach(0)
    assert all(r.code == 0 for r in core.add_requests(requests))
    tokens: dict[int, list[int]] = {r.seq_id: [] for r in requests}
    finished: dict[int, tuple[list[int], FinishReason]] = {}

    async def drain() -> None:
        while len(finished) < len(requests):
            event = await queue.get()
            if event.outputs is None:
                continue
            for seq_id, token_id in zip(event.outputs.seq_ids, event.outputs.token_ids):
                tokens[seq_id].append(token_id)
            for f in event.outputs.finished:
                finished[f.seq_id] = (tokens[f.seq_id], f.reason)

    await asyncio.wait_for(drain(), timeout_s)
    return finished


def test_a_worker_restart_logs_the_requests_it_was_computing(caplog):
    """Three requests run on the worker when it dies, two more wait for a slot: the restart
    re-sends the three in full, and the log says three (not five, not zero)."""
    async def scenario() -> dict:
        client = FakeWorkerClient(die_at={4}, num_blocks=64, block_size=4, vocab_size=50)
        core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[0],
                          config=EngineConfig(max_num_seqs=3, reconnect_interval_s=0.001))
        await core.start()
        assert await core.wait_ready(timeout_s=10)
        requests = [CoreRequest(make_seq_id(0, i + 1), f"r{i}", [i + 1, 2, 3],
                                SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(5)]
        try:
            return await _run_to_completion(core, requests)
        finally:
            await core.shutdown(grace_s=0)

    with caplog.at_level(logging.INFO, logger="scheduler_svc.engine.group_runner"):
        finished = asyncio.run(scenario())
    assert sorted((len(t), reason) for t, reason in finished.values()) == [(12, FinishReason.LENGTH)] * 5
    restarts = [r.getMessage() for r in caplog.records if "worker restarted" in r.getMessage()]
    assert restarts == ["group 0: worker restarted; re-sending in full the 3 requests it was computing "
                        "(2 more waiting were not on it yet)"]


def test_two_engines_on_one_worker_take_turns_by_its_lease():
    """Engine "a" holds the worker; engine "b" waits, saying who holds it, while "a" serves as if
    alone; once "a" stops (and so stops renewing), "b" takes the worker over within the lease.
    The lease is long enough (ten of "a"'s idle renewals) that a loaded machine's stalls do not let
    it lapse while "a" holds it; the bounds stay far below the 15 s a claim may be granted at most."""
    lease_s = 1.0

    def engine(name: str, client: FakeWorkerClient) -> EngineCore:
        return EngineCore([WorkerGroupClient([client])], eos_token_ids=[0], config=EngineConfig(
            max_num_seqs=4, reconnect_interval_s=0.05, idle_probe_interval_s=0.1, instance_id=name,
            worker_lease_s=lease_s))

    def requests(tag: str) -> list[CoreRequest]:
        return [CoreRequest(make_seq_id(0, i + 1), f"{tag}{i}", [i + 1, 7, 3],
                            SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(6)]

    async def scenario() -> None:
        alone = await _alone()
        client = FakeWorkerClient(num_blocks=64, block_size=4, vocab_size=50, step_s=0.01)
        a, b = engine("a", client), engine("b", client)
        await a.start()
        assert await a.wait_ready(timeout_s=10)
        await b.start()
        assert not await b.wait_ready(timeout_s=2 * lease_s)      # "a"'s renewals keep it past its lease
        assert "leased to scheduler 'a'" in b.status.reason
        assert await _run_to_completion(a, requests("a")) == alone
        assert not b.status.accepting
        await a.shutdown(grace_s=0)
        stopped = asyncio.get_running_loop().time()
        assert await b.wait_ready(timeout_s=10)
        took = asyncio.get_running_loop().time() - stopped
        # About the lease (1.04-1.09 s with six busy loops on two cores); the bound is
        # generous slack for a loaded machine, yet far below any longer lease (15 s at most).
        assert took < lease_s + 3.0, f"took the worker over after {took:.2f} s; the lease is {lease_s} s"
        assert await _run_to_completion(b, requests("b")) == alone
        await b.shutdown(grace_s=0)

    async def _alone() -> dict:
        core = engine("solo", FakeWorkerClient(num_blocks=64, block_size=4, vocab_size=50, step_s=0.01))
        await core.start()
        assert await core.wait_ready(timeout_s=10)
        try:
            return await _run_to_completion(core, requests("solo"))
        finally:
            await core.shutdown(grace_s=0)

    asyncio.run(scenario())


def test_a_scheduler_without_step_limits_takes_what_its_workers_report():
    """Unset limits follow the worker: the scheduler's steps never hold more requests or tokens
    than the worker warmed up for."""
    async def scenario() -> tuple:
        client = FakeWorkerClient(num_blocks=64, block_size=4, vocab_size=50, max_num_seqs=3, max_num_batched_tokens=8)
        core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[0], config=EngineConfig())
        await core.start()
        assert await core.wait_ready(timeout_s=10)
        requests = [CoreRequest(make_seq_id(0, i + 1), f"r{i}", [i + 1, 2, 3, 4, 5, 6],
                                SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(5)]
        try:
            finished = await _run_to_completion(core, requests)
            return core.groups[0].scheduler.config, finished
        finally:
            await core.shutdown(grace_s=0)

    config, finished = asyncio.run(scenario())
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (3, 8)
    assert sorted(len(tokens) for tokens, _ in finished.values()) == [4] * 5


def test_a_scheduler_limit_above_its_workers_is_refused_at_connect_naming_both_numbers(caplog):
    async def scenario() -> str:
        client = FakeWorkerClient(max_num_batched_tokens=2048)
        core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[0],
                          config=EngineConfig(max_num_batched_tokens=4096, reconnect_interval_s=0.01))
        await core.start()
        try:
            # The refusal is reported once the first connect is tried: waited for, not assumed within 0.3 s.
            deadline = asyncio.get_running_loop().time() + 30
            while "--max-num-batched-tokens" not in (core.status.reason or ""):
                assert asyncio.get_running_loop().time() < deadline, core.status.reason
                assert not await core.wait_ready(timeout_s=0.05)
            return core.status.reason
        finally:
            await core.shutdown(grace_s=0)

    with caplog.at_level(logging.INFO, logger="scheduler_svc.engine.group_runner"):
        reason = asyncio.run(scenario())
    assert "--max-num-batched-tokens 4096 is more than the 2048 the workers of group 0 (fake) take" in reason
    [record] = [r for r in caplog.records if "4096" in r.getMessage()]
    assert record.levelno == logging.ERROR


def test_a_groups_step_limits_are_its_tightest_ranks():
    from common.pb.llm.worker.v1 import worker_pb2
    from scheduler_svc.engine.group_runner import GroupRunner

    runner = GroupRunner(0, WorkerGroupClient([FakeWorkerClient(), FakeWorkerClient()]), EngineConfig(), [0],
                         metrics=None, hooks=None)
    infos = [worker_pb2.WorkerInfo(max_model_len=64, block_size=4, num_kv_blocks=16, max_num_seqs=seqs,
                                   max_num_batched_tokens=tokens, max_held_requests=held)
             for seqs, tokens, held in ((8, 512, 16), (6, 1024, 12), (8, 512, 0))]   # 0: no bound said
    config = runner.scheduler_config(infos)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_held_requests) == (6, 512, 12)
    assert runner.scheduler_config(infos[2:]).max_held_requests == 0


def test_a_request_that_makes_the_worker_fail_is_failed_alone_after_bounded_retries():
    """Every step holding the poisoned request crashes the worker. After the first crash its
    requests come back one at a time, so the poisoned one is blamed alone; at
    max_request_failures it is failed (INTERNAL), and the others finish with the tokens they get
    when there is no poison at all."""
    def requests(poisoned: bool) -> list[CoreRequest]:
        prompts = [[1, 2, 3], [2, 2, 3], [5, 2, 3] if poisoned else [4, 4, 4], [3, 2, 3], [6, 2, 3]]
        return [CoreRequest(make_seq_id(0, i + 1), f"r{i}", p, SamplingParams(max_tokens=10, ignore_eos=True))
                for i, p in enumerate(prompts)]

    async def scenario(poisoned: bool) -> tuple[dict, dict, int]:
        client = FakeWorkerClient(num_blocks=64, block_size=4, vocab_size=50, poison={5})
        core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[0], config=EngineConfig(
            max_num_seqs=8, reconnect_interval_s=0.001, max_request_failures=2))
        await core.start()
        assert await core.wait_ready(timeout_s=10)
        queue = core.attach(0)
        batch = requests(poisoned)
        assert all(r.code == 0 for r in core.add_requests(batch))
        tokens = {r.seq_id: [] for r in batch}
        errors, done = {}, set()
        try:
            while len(done) < len(batch):
                event = await asyncio.wait_for(queue.get(), 30)
                if event.outputs is None:
                    continue
                for seq_id, token_id in zip(event.outputs.seq_ids, event.outputs.token_ids):
                    tokens[seq_id].append(token_id)
                for f in event.outputs.finished:
                    done.add(f.seq_id)
                    if f.error is not None:
                        errors[f.seq_id] = f.error
        finally:
            await core.shutdown(grace_s=0)
        return tokens, errors, client.restarts

    clean, no_errors, no_restarts = asyncio.run(scenario(False))
    tokens, errors, restarts = asyncio.run(scenario(True))
    poisoned = make_seq_id(0, 3)
    assert no_errors == {} and no_restarts == 0
    assert list(errors) == [poisoned] and errors[poisoned].code == "INTERNAL"
    assert "failed 2 times while computing this request" in errors[poisoned].message
    assert restarts == 3        # the first crash, then two that it alone was blamed for
    assert {s: t for s, t in tokens.items() if s != poisoned} == {s: t for s, t in clean.items() if s != poisoned}
