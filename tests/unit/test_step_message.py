"""The step message: full requests once per admission, O(batch) diffs afterwards."""
from __future__ import annotations

import random

from common.pb.llm.worker.v1 import worker_pb2
from common.record_codec import decode
from scheduler_svc.engine.block_manager import BlockManager
from common.sampling import SamplingParams
from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.sequence import Sequence
from scheduler_svc.engine.step_message import build_step_request
from worker_svc.layers.sampler import SamplingOptions


def make_scheduler(num_blocks: int, block_size: int, budget: int = 2048) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                             max_model_len=num_blocks * block_size, block_size=block_size)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def run_step(sched: Scheduler, step_id: int = 1) -> worker_pb2.StepRequest:
    """Schedules and encodes one step, then applies a sampled token where one is due."""
    output = sched.schedule()
    request = build_step_request(step_id, output)
    sched.update(output, [random.randrange(150_000) for _ in output.sampling_seqs])
    return request


def decode_step_size(context: int) -> int:
    # Block size 32: neither context makes the first decode open a new block.
    sched = make_scheduler(num_blocks=400, block_size=32)
    seq = Sequence(1, "r", [random.randrange(150_000) for _ in range(context)],
                   SamplingParams(max_tokens=8))
    sched.add(seq)
    while seq.num_output_tokens == 0:
        run_step(sched)                                  # chunked prefill
    request = run_step(sched, step_id=99)
    cached = request.cached
    assert not request.new_requests and list(cached.seq_ids) == [1]
    assert not cached.multi_token_indices and not cached.new_block_indices
    return request.ByteSize()


def test_decode_step_size_does_not_grow_with_context():
    assert decode_step_size(10) == decode_step_size(10_000)


def test_new_request_is_sent_once_and_again_after_preemption():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    params = SamplingParams(temperature=0.5, seed=1234, max_tokens=12, logprobs=True)
    a = Sequence(1, "a", [1, 2, 3, 4], params)
    b = Sequence(2, "b", [5, 6, 7, 8], SamplingParams(max_tokens=12, prompt_logprobs=True))
    sched.add(a)
    sched.add(b)
    first = run_step(sched)
    assert [r.seq_id for r in first.new_requests] == [1, 2] and not first.cached.seq_ids
    new_a = first.new_requests[0]
    assert list(new_a.token_ids) == [1, 2, 3, 4] and new_a.num_prompt_tokens == 4
    assert (new_a.num_computed_tokens, new_a.num_scheduled_tokens) == (0, 4)
    assert list(new_a.block_ids) == a.block_table[:1]
    assert decode(new_a.sampling, SamplingOptions) == SamplingOptions(temperature=0.5, seed=1234, logprobs=True)
    for _ in range(4):                                   # positions 4..7: the cache fills up
        request = run_step(sched)
        assert not request.new_requests and list(request.cached.seq_ids) == [1, 2]
    preempting = run_step(sched)                         # a needs a third block: b goes
    assert list(preempting.finished_seq_ids) == [2]
    assert list(preempting.cached.seq_ids) == [1]
    assert list(preempting.cached.new_block_indices) == [0]
    assert list(preempting.cached.new_block_counts) == [len(a.block_table) - 2]
    assert list(preempting.cached.new_block_ids) == a.block_table[2:]
    while sched.num_waiting:                             # a finishes, then b is re-admitted
        request = run_step(sched)
    assert list(request.finished_seq_ids) == [1]
    (again,) = request.new_requests
    assert again.seq_id == 2 and list(again.token_ids) == b.token_ids[:-1]
    assert again.num_prompt_tokens == 4 and len(again.token_ids) == 9
    # Its prompt was scored before the preemption: the recomputation does not score it again.
    assert first.new_requests[1].sampling.prompt_logprobs and not again.sampling.prompt_logprobs
    assert list(again.block_ids) == b.block_table


def test_the_worker_parses_the_sparse_columns_and_refuses_malformed_ones():
    """The cached requests' sparse columns (multi-token counts, new blocks, drafts): absent, as most decode steps
    send them; present; and each way of contradicting itself, refused with what was wrong."""
    import numpy as np
    import pytest

    from worker_svc.runner_io import InvalidStepError
    from worker_svc.step_message import parse_step_request

    def parse(**columns):
        return parse_step_request(worker_pb2.StepRequest(step_id=3, cached=worker_pb2.CachedRequests(
            seq_ids=[10, 11, 12], **columns)))

    plain = parse()
    assert plain.num_scheduled.tolist() == [1, 1, 1] and plain.num_drafts is None
    assert (len(plain.new_block_indices), len(plain.new_block_counts), len(plain.new_block_ids)) == (0, 0, 0)
    assert all(a.dtype == np.int64 for a in (plain.new_block_indices, plain.new_block_counts, plain.new_block_ids))
    full = parse(multi_token_indices=[1], multi_token_counts=[4], new_block_indices=[0, 2], new_block_counts=[1, 2],
                 new_block_ids=[7, 8, 9], draft_indices=[2], draft_counts=[3])
    assert full.num_scheduled.tolist() == [1, 4, 1] and full.num_drafts.tolist() == [0, 0, 3]
    assert (full.new_block_indices.tolist(), full.new_block_counts.tolist(), full.new_block_ids.tolist()) == (
        [0, 2], [1, 2], [7, 8, 9])
    for columns, why in (
            ({"multi_token_indices": [1]}, "1 multi_token_indices but 0 multi_token_counts"),
            ({"multi_token_counts": [2]}, "0 multi_token_indices but 1 multi_token_counts"),
            ({"multi_token_indices": [1], "multi_token_counts": [1]}, "must be at least 2"),
            ({"multi_token_indices": [3], "multi_token_counts": [2]}, "must ascend within 0..2"),
            ({"multi_token_indices": [1, 1], "multi_token_counts": [2, 2]}, "must ascend"),
            ({"new_block_ids": [5]}, "add up to the 1 new_block_ids"),
            ({"new_block_indices": [0], "new_block_counts": [2], "new_block_ids": [5]}, "add up to the 1"),
            ({"new_block_indices": [0], "new_block_counts": [0]}, "must be positive"),
            ({"draft_indices": [0], "draft_counts": [0]}, "draft_counts must be positive")):
        with pytest.raises(InvalidStepError, match=why):
            parse(**columns)
