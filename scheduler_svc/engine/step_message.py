"""The scheduler's side of the step wire: a SchedulerOutput becomes the worker's StepRequest, and
a StepResponse becomes plain lists. worker_svc/step_message.py is the mirror image.

The size of a step is O(batch + new blocks): a request's tokens travel only in its NewRequest
(once per admission); a request the worker holds costs its seq_id in a packed column, plus an
entry in the sparse columns when it computes more than one token or gains blocks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from common.pb.llm.common.v1 import top_logprobs_pb2
from common.pb.llm.worker.v1 import worker_pb2
from common.record_codec import encode
from scheduler_svc.engine.api import RequestError, TopLogprobColumns
from scheduler_svc.engine.scheduler_output import NewRequestData, SchedulerOutput


def _new_request(r: NewRequestData) -> worker_pb2.NewRequest:
    sampling = r.sampling
    if sampling.prompt_logprobs and len(r.token_ids) > r.num_prompt_tokens:
        # Re-sent with output tokens: its prompt was scored before it was preempted, and is
        # recomputed without scoring it again.
        sampling = dataclasses.replace(sampling, prompt_logprobs=False)
    msg = worker_pb2.NewRequest(**_fields(r, but="sampling"))
    encode(sampling, msg.sampling)
    return msg


def _fields(record, but: str = "") -> dict[str, Any]:
    """A record's fields by name, for the message that names its fields the same (all but `but`)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name != but}


def build_step_request(step_id: int, output: SchedulerOutput) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(
        step_id=step_id,
        # The worker drops these before running the step, so a request preempted earlier and
        # re-admitted now (as a NewRequest) starts from a clean row.
        finished_seq_ids=output.finished_seq_ids + output.preempted_seq_ids,
        new_requests=[_new_request(r) for r in output.new_requests],
        cached=worker_pb2.CachedRequests(**_fields(output.cached)),
        propose_drafts=output.propose_drafts,
    )


@dataclass(frozen=True, slots=True)
class StepPromptLogprobs:
    """Prompt tokens scored by one step: request i, counts[i] tokens from first_positions[i] on
    (a recomputed prompt is scored again: the core keeps what it already had)."""
    seq_ids: list[int]
    first_positions: list[int]
    counts: list[int]
    logprobs: list[float]
    top: TopLogprobColumns | None


@dataclass(frozen=True, slots=True)
class StepResult:
    """A worker's answer to one step: a token (and, when asked, a logprob) per sampling
    sequence of the step, in its order, or token_counts[i] of them for sequence i."""
    token_ids: list[int]
    logprobs: list[float] | None     # None when no request of the step asked
    forward_ms: float                # the worker's host time launching the forward
    device_ms: float                 # the step's device time (0 on the CPU)
    top_logprobs: TopLogprobColumns | None = None   # parallel to token_ids, when any asked
    prompt_logprobs: StepPromptLogprobs | None = None
    # Requests the worker cannot go on with (seq_id -> why): their token in this step is void.
    failed: dict[int, RequestError] = field(default_factory=dict)
    # Speculative decoding: tokens per sampling sequence (empty: one each), and the drafts the
    # worker holds for each for the next step (empty: none).
    token_counts: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    verified_drafts: list[int] = field(default_factory=list)   # parallel to token_counts, when any verified


def _top_columns(msg: top_logprobs_pb2.TopLogprobColumns) -> TopLogprobColumns | None:
    if not len(msg.counts):
        return None
    return TopLogprobColumns(list(msg.counts), list(msg.token_ids), list(msg.logprobs))


def parse_step_response(response: worker_pb2.StepResponse) -> StepResult:
    t = response.timings
    prompt = None
    p = response.prompt_logprobs
    if len(p.seq_ids):
        prompt = StepPromptLogprobs(list(p.seq_ids), list(p.first_positions), list(p.counts), list(p.logprobs),
                                _top_columns(p.top))
    failed = {f.seq_id: RequestError(f.code, f.message, f.about_constraint) for f in response.failed}
    return StepResult(list(response.token_ids), list(response.logprobs) or None, t.forward_ms, t.device_ms,
                      _top_columns(response.top_logprobs), prompt, failed, list(response.token_counts),
                      list(response.num_drafts), list(response.verified_drafts))
