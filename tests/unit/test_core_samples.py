"""The engine core's handling of a request's samples (n > 1): later samples wait for sample 0's
prompt and then reuse its cached blocks, they run on when sample 0 ends early, the request is
admitted or refused as a whole, and an abort by request id ends them all."""
from __future__ import annotations

import asyncio

from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.engine.api import AddCode, CoreRequest, make_seq_id
from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import FinishReason
from scheduler_svc.engine.worker_client import WorkerGroupClient
from tests.unit.test_async_scheduling import EOS, FakeWorkerClient

PROMPT = [1, 2, 3, 4, 5]          # two full blocks of 2, then one token


def samples(n: int, request_id: str = "r", **params) -> list[CoreRequest]:
    sampling = SamplingParams(max_tokens=3, ignore_eos=True, n=n, **params)
    return [CoreRequest(make_seq_id(0, 100 * len(request_id) + i), request_id, PROMPT, sampling.for_sample(i), i)
            for i in range(n)]


async def run(test) -> dict[int, tuple[FinishReason, int, int]]:
    """Runs `test(core)` on a core over a fake worker; returns every ending it published, by seq_id:
    (reason, output tokens, cached prompt tokens)."""
    core = EngineCore([WorkerGroupClient([FakeWorkerClient()])], eos_token_ids=[EOS],
                      config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=16))
    events = core.attach(0)
    await core.start()
    assert await core.wait_ready(timeout_s=10)
    endings = {}
    try:
        expected = test(core)
        while len(endings) < expected:
            event = await asyncio.wait_for(events.get(), timeout=10)
            for f in event.outputs.finished if event.outputs else ():
                endings[f.seq_id] = (f.reason, f.num_output_tokens, f.num_cached_prompt_tokens)
    finally:
        await core.shutdown(grace_s=0)
    return endings


def test_later_samples_wait_for_the_prompt_of_sample_0_and_reuse_its_blocks():
    requests = samples(3)

    def test(core):
        assert [r.code for r in core.add_requests(requests)] == [AddCode.OK] * 3
        assert core.num_waiting() == 1           # samples 1 and 2 wait in the core, not the queue
        return 3

    endings = asyncio.run(run(test))
    assert [endings[r.seq_id] for r in requests] == [(FinishReason.LENGTH, 3, 0), (FinishReason.LENGTH, 3, 4),
                                                      (FinishReason.LENGTH, 3, 4)]


def test_samples_run_on_when_sample_0_ends_before_its_prompt_is_computed():
    requests = samples(3)

    def test(core):
        core.add_requests(requests)
        core.abort([requests[0].seq_id], FinishReason.ABORT, notify=True)
        return 3

    endings = asyncio.run(run(test))
    assert endings[requests[0].seq_id][0] is FinishReason.ABORT
    assert [endings[r.seq_id][:2] for r in requests[1:]] == [(FinishReason.LENGTH, 3)] * 2


def test_an_abort_by_request_id_ends_every_sample_and_a_sample_index_is_taken_once():
    requests = samples(3, "whole")

    def test(core):
        core.add_requests(requests)
        duplicate = CoreRequest(make_seq_id(0, 999), "whole", PROMPT, requests[1].sampling, 1)
        assert core.add_requests([duplicate])[0].code is AddCode.ALREADY_EXISTS
        assert core.add_requests([CoreRequest(make_seq_id(0, 998), "whole", PROMPT, requests[0].sampling)])[0].code \
            is AddCode.ALREADY_EXISTS
        assert core.abort_request_id("whole")
        return 3

    endings = asyncio.run(run(test))
    assert {endings[r.seq_id][0] for r in requests} == {FinishReason.ABORT}
