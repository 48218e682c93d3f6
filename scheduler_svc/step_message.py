"""Encodes a SchedulerOutput as the worker's StepRequest.

The size of a step is O(batch + new blocks): a request's tokens travel only in its
NewRequest (once per admission); a request the worker mirrors costs a few bytes per step,
whatever its context length.
"""
from __future__ import annotations

from common.pb.llm.worker.v1 import worker_pb2
from scheduler_svc.scheduler import SchedulerOutput


def build_step_request(step_id: int, output: SchedulerOutput) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(
        step_id=step_id,
        # The worker drops these mirrors before running the step, so a request preempted
        # earlier and re-admitted now (as a NewRequest) starts from a clean mirror.
        finished_seq_ids=output.finished_seq_ids + output.preempted_seq_ids,
        new_requests=[
            worker_pb2.NewRequest(
                seq_id=r.seq_id,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                block_ids=r.block_ids,
                sampling=r.sampling.to_worker_options(),
            )
            for r in output.new_requests
        ],
        cached_requests=[
            worker_pb2.CachedRequest(
                seq_id=r.seq_id,
                num_scheduled_tokens=r.num_scheduled_tokens,
                new_block_ids=r.new_block_ids,
            )
            for r in output.cached_requests
        ],
    )
