"""--step-log: the engine core writes a line per applied step, and the service bench's summary of it
splits a run into decode-only and mixed steps by batch size."""
from __future__ import annotations

import asyncio

from scheduler_svc.engine import step_log
from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.engine.worker_client import WorkerGroupClient
from scheduler_svc.frontend.core_client import LocalCoreClient
from scheduler_svc.frontend.streams import Frontend
from common.sampling import SamplingParams
from tests.support.fake_worker import FakeWorkerClient
from tests.unit.test_async_scheduling import letter_tokenizer


async def _run(path, client: FakeWorkerClient, requests) -> None:
    core = EngineCore([WorkerGroupClient([client])], eos_token_ids=[0],
                      config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, reconnect_interval_s=0.001,
                                          step_log=str(path)))
    frontend = Frontend(LocalCoreClient(core), letter_tokenizer())
    events = asyncio.create_task(frontend.run())
    await core.start()
    assert await core.wait_ready(timeout_s=10)
    try:
        streams = [await frontend.submit(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]

        async def drain(stream):
            async for _ in stream:
                pass
        await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=30)
    finally:
        await core.shutdown(grace_s=0)
        events.cancel()


def test_a_line_per_step_and_its_summary(tmp_path):
    path = tmp_path / "steps.tsv"
    client = FakeWorkerClient(num_blocks=64, block_size=4)
    # Three prompts of 6 tokens (no prefix shared) in a budget of 8: chunked prefills mixed with
    # decodes, then decodes.
    requests = [([i, 2, 3, 4, 5, 1], SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(1, 4)]
    asyncio.run(_run(path, client, requests))

    lines = path.read_text().splitlines()
    assert lines[0].split("\t") == list(step_log.FIELDS)
    rows = [dict(zip(step_log.FIELDS, line.split("\t"))) for line in lines[1:]]
    assert len(rows) == client.num_steps
    assert sum(int(r["tokens"]) for r in rows) == 3 * 6 + 3 * 4    # prompts, then each later token once
    assert sum(int(r["sampled"]) for r in rows) == 3 * 5
    assert [float(r["reply_s"]) for r in rows] == sorted(float(r["reply_s"]) for r in rows)
    # The first step computes the first prompt tokens: its KV is its own tokens; each later step's
    # is every context so far. Over the run the last step's context sums to prompts + outputs but one.
    assert rows[0]["kv_tokens"] == rows[0]["tokens"]
    assert int(rows[-1]["kv_tokens"]) <= 3 * (6 + 4)
    assert all(int(a["kv_tokens"]) <= int(b["kv_tokens"]) or int(b["seqs"]) < int(a["seqs"])
               for a, b in zip(rows, rows[1:]))

    summary = step_log.summarize(path)
    assert summary["steps"] == len(rows) and summary["tokens"] == 3 * 6 + 3 * 4
    kinds = summary["kinds"]
    assert set(kinds) <= {"decode <=1", "decode <=4", "mixed <=1", "mixed <=4"}
    assert sum(k["steps"] for k in kinds.values()) == len(rows)
    decodes = sum(k["tokens"] for name, k in kinds.items() if name.startswith("decode"))
    assert 0 < decodes < 3 * 4 + 1 and any(name.startswith("mixed") for name in kinds)
    assert summary["span_s"] > 0 and summary["floor_ms"] == 0
    # A floor of 1 ms a KV token sums to the KV tokens, and the report grows its floor columns.
    floored = step_log.summarize(path, floor_ms=lambda seqs, sampled, tokens, kv_tokens: float(kv_tokens))
    assert floored["floor_ms"] == sum(int(r["kv_tokens"]) for r in rows)
    assert "dev/floor" in step_log.report_lines(floored)[1] and "dev/floor" not in step_log.report_lines(summary)[1]
    # A window that holds none of the steps, and a cut-off last line, count nothing.
    assert step_log.summarize(path, end_s=float(rows[0]["reply_s"]) - 1)["steps"] == 0
    path.write_text(path.read_text() + "0\t1.0\t2")
    assert step_log.summarize(path)["steps"] == len(rows)
    assert any("decode" in line for line in step_log.report_lines(summary))


def test_buckets():
    assert [step_log.bucket(n) for n in (1, 2, 4, 5, 256, 257, 600)] == \
        ["<=1", "<=4", "<=4", "<=16", "<=256", "<=512", ">512"]
