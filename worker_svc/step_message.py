"""The worker's side of the step wire: a StepRequest becomes a plain StepInput, and a step's
result becomes a StepResponse. scheduler_svc/engine/step_message.py is the mirror image; ModelRunner
and the sampler never see protobuf.

Parsing checks what the message says about itself (well-formed columns, sane sampling
options); what it says against the worker's state is checked by the runner. Either failure is
an InvalidStepError, raised before anything changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.constraint import KINDS, Constraint
from common.pb.llm.worker.v1 import worker_pb2
from worker_svc.layers.sampler import SamplingOptions

MAX_TOP_LOGPROBS = 20


class InvalidStepError(ValueError):
    """The step contradicts itself or the worker's limits; nothing was changed."""


class StaleMirrorError(InvalidStepError):
    """The step names requests this worker does not hold (or already holds): its state and the
    scheduler's view differ, e.g. after a worker restart. The scheduler should re-send them."""


@dataclass(slots=True)
class NewRequest:
    seq_id: int
    token_ids: list[int]            # every token known: prompt, then output so far
    num_prompt_tokens: int
    num_computed_tokens: int        # KV already in the cache (prefix-cache hit)
    num_scheduled_tokens: int
    block_ids: list[int]
    sampling: SamplingOptions
    constraint: Constraint | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class StepInput:
    """One step. Batch order: the cached requests (columns), then the new ones."""
    step_id: int
    finished_seq_ids: list[int]
    new_requests: list[NewRequest]
    cached_seq_ids: list[int]
    num_scheduled: np.ndarray       # int64 [len(cached_seq_ids)]: tokens each cached request computes
    new_block_indices: np.ndarray   # int64: cached entries whose block table grows, ascending
    new_block_counts: np.ndarray    # int64: how many ids each of those gets
    new_block_ids: np.ndarray       # int64: the ids, concatenated

    @property
    def num_requests(self) -> int:
        return len(self.cached_seq_ids) + len(self.new_requests)


@dataclass(slots=True)
class TopLogprobs:
    """The most likely tokens at several positions: entry i is counts[i] values of token_ids and
    logprobs (concatenated), most likely first; 0 for a position whose request did not ask."""
    counts: list[int]
    token_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    """Prompt tokens a step scored: request seq_ids[i], counts[i] tokens from first_positions[i]."""
    seq_ids: list[int]
    first_positions: list[int]
    counts: list[int]
    logprobs: list[float]
    top: TopLogprobs | None         # one entry per scored token, when any of them asked


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """A request this worker cannot go on with (its grammar does not compile, its masks cost more
    than the budget, ...): the scheduler ends it with this status; its token in the step is void."""
    seq_id: int
    code: str                       # a gRPC status code name, e.g. "INVALID_ARGUMENT"
    message: str
    about_constraint: bool = False  # the message reads after the constraint field's name


@dataclass(slots=True)
class StepOutput:
    """A step's sampled tokens, in batch order (one per request that samples), on the host."""
    step_id: int
    token_ids: list[int]
    logprobs: list[float] | None    # None when no request asked
    prepare_ms: float
    forward_ms: float
    total_ms: float
    device_ms: float = 0.0
    top_logprobs: TopLogprobs | None = None       # parallel to token_ids, when any request asked
    prompt_logprobs: PromptLogprobs | None = None
    failed: tuple[RequestFailure, ...] = ()


def sampling_options_from_proto(pb: worker_pb2.SamplingOptions) -> SamplingOptions:
    """proto3 cannot tell an unset float from 0, and 0 is meaningless for top_p and
    repetition_penalty, so 0 there means off. Raises ValueError for nonsense values."""
    options = SamplingOptions(
        temperature=pb.temperature,
        top_p=pb.top_p or 1.0,
        top_k=pb.top_k,
        min_p=pb.min_p,
        seed=pb.seed if pb.HasField("seed") else None,
        repetition_penalty=pb.repetition_penalty or 1.0,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        logprobs=pb.logprobs or pb.top_logprobs > 0,
        top_logprobs=pb.top_logprobs,
        prompt_logprobs=pb.prompt_logprobs,
        logit_bias=_logit_bias(pb),
    )
    options.validate()
    if options.top_logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs {options.top_logprobs} > {MAX_TOP_LOGPROBS}")
    return options


def _logit_bias(pb: worker_pb2.SamplingOptions) -> tuple[tuple[int, float], ...]:
    ids, values = pb.logit_bias_token_ids, pb.logit_bias_values
    if len(ids) != len(values):
        raise ValueError(f"logit_bias has {len(ids)} token ids but {len(values)} values")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError("logit_bias token ids must be ascending, each once")
    return tuple(zip(ids, values))


def constraint_from_proto(new: worker_pb2.NewRequest) -> Constraint | None:
    """The request's constraint (its grammar is compiled by the runner). Raises ValueError."""
    if not new.HasField("constraint"):
        return None
    if new.constraint.kind not in KINDS:
        raise ValueError(f"unknown constraint kind {new.constraint.kind!r}; expected one of {', '.join(KINDS)}")
    return Constraint(new.constraint.kind, new.constraint.text)


def _sparse_indices(name: str, indices, counts, size: int, step_id: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.array(indices, dtype=np.int64)
    cnt = np.array(counts, dtype=np.int64)
    if len(idx) != len(cnt):
        raise InvalidStepError(f"step {step_id}: {len(idx)} {name}_indices but {len(cnt)} {name}_counts")
    if len(idx) and (idx[0] < 0 or idx[-1] >= size or np.any(np.diff(idx) <= 0)):
        raise InvalidStepError(f"step {step_id}: {name}_indices must ascend within 0..{size - 1}")
    return idx, cnt


def parse_step_request(req: worker_pb2.StepRequest) -> StepInput:
    step_id = req.step_id
    new_requests = []
    for new in req.new_requests:
        try:
            options = sampling_options_from_proto(new.sampling)
            constraint = constraint_from_proto(new)
        except ValueError as exc:
            raise InvalidStepError(f"step {step_id}, new request {new.seq_id}: {exc}") from None
        new_requests.append(NewRequest(new.seq_id, list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                                       new.num_scheduled_tokens, list(new.block_ids), options, constraint))
    cached = req.cached
    seq_ids = list(cached.seq_ids)
    multi_idx, multi_cnt = _sparse_indices("multi_token", cached.multi_token_indices, cached.multi_token_counts,
                                           len(seq_ids), step_id)
    if np.any(multi_cnt < 2):
        raise InvalidStepError(f"step {step_id}: multi_token_counts must be at least 2 (one is the default)")
    num_scheduled = np.ones(len(seq_ids), dtype=np.int64)
    num_scheduled[multi_idx] = multi_cnt
    block_idx, block_cnt = _sparse_indices("new_block", cached.new_block_indices, cached.new_block_counts,
                                           len(seq_ids), step_id)
    block_ids = np.array(cached.new_block_ids, dtype=np.int64)
    if np.any(block_cnt < 1) or int(block_cnt.sum()) != len(block_ids):
        raise InvalidStepError(f"step {step_id}: new_block_counts (sum {int(block_cnt.sum())}) must be positive "
                               f"and add up to the {len(block_ids)} new_block_ids")
    return StepInput(step_id, list(req.finished_seq_ids), new_requests, seq_ids, num_scheduled,
                     block_idx, block_cnt, block_ids)


def _top_to_proto(top: TopLogprobs, msg: worker_pb2.TopLogprobColumns) -> None:
    msg.counts.extend(top.counts)
    msg.token_ids.extend(top.token_ids)
    msg.logprobs.extend(top.logprobs)


def build_step_response(output: StepOutput) -> worker_pb2.StepResponse:
    msg = worker_pb2.StepResponse(
        step_id=output.step_id,
        token_ids=output.token_ids,
        logprobs=output.logprobs or (),
        timings=worker_pb2.StepTimings(prepare_ms=output.prepare_ms, forward_ms=output.forward_ms,
                                       total_ms=output.total_ms, device_ms=output.device_ms),
    )
    if output.top_logprobs is not None:
        _top_to_proto(output.top_logprobs, msg.top_logprobs)
    prompt = output.prompt_logprobs
    if prompt is not None:
        target = msg.prompt_logprobs
        target.seq_ids.extend(prompt.seq_ids)
        target.first_positions.extend(prompt.first_positions)
        target.counts.extend(prompt.counts)
        target.logprobs.extend(prompt.logprobs)
        if prompt.top is not None:
            _top_to_proto(prompt.top, target.top)
    for f in output.failed:
        msg.failed.add(seq_id=f.seq_id, code=f.code, message=f.message, about_constraint=f.about_constraint)
    return msg
