"""The worker's wire: a StepRequest becomes a plain StepInput, a step's result becomes a
StepResponse, and the runner's WorkerInfo becomes the Describe answer (the plain types are in
runner_io.py). scheduler_svc/engine/step_message.py is the mirror image; ModelRunner and the
sampler never see protobuf.

Parsing checks what the message says about itself (well-formed columns, sane sampling
options); what it says against the worker's state is checked by step_checks.py. Either failure is
an InvalidStepError, raised before anything changes.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from common.constraint import KINDS, Constraint
from common.pb.llm.worker.v1 import worker_pb2
from worker_svc.layers.sampler import SamplingOptions
from worker_svc.runner_io import InvalidStepError, NewRequest, StepInput, StepOutput, TopLogprobs, WorkerInfo

MAX_TOP_LOGPROBS = 20


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
    return msg


def build_worker_info(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(**dataclasses.asdict(info))
