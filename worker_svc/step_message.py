"""The worker's wire: a StepRequest becomes a plain StepInput, a step's result becomes a
StepResponse, and the runner's WorkerInfo becomes the Describe answer (the plain types are in
runner_io.py). scheduler_svc/engine/step_message.py is the mirror image; ModelRunner and the
sampler never see protobuf.

Parsing checks what the message says about itself (well-formed columns, sampling options
within common/sampling_bounds.py); what it says against the worker's state is checked by step_checks.py. Either failure is
an InvalidStepError, raised before anything changes.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from common.pb.llm.common.v1 import top_logprobs_pb2
from common.pb.llm.worker.v1 import worker_pb2
from common.record_codec import decode
from worker_svc.layers.sampler import SamplingOptions
from worker_svc.runner_io import InvalidStepError, NewRequest, StepInput, StepOutput, TopLogprobs, WorkerInfo

def sampling_options_from_proto(pb: worker_pb2.SamplingOptions) -> SamplingOptions:
    """The request's sampling options; ValueError for values out of their bounds or a bad constraint."""
    options = decode(pb, SamplingOptions)
    options.validate()
    return options


def _sparse_indices(name: str, indices, counts, size: int, step_id: int) -> tuple[np.ndarray, np.ndarray]:
    if not indices and not counts:   # most steps: no request with more than one token or a new block
        return np.empty(0, np.int64), np.empty(0, np.int64)
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
        except ValueError as exc:
            raise InvalidStepError(f"step {step_id}, new request {new.seq_id}: {exc}") from None
        new_requests.append(NewRequest(new.seq_id, list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                                       new.num_scheduled_tokens, list(new.block_ids), options))
    cached = req.cached
    seq_ids = list(cached.seq_ids)
    multi_idx, multi_cnt = _sparse_indices("multi_token", cached.multi_token_indices, cached.multi_token_counts,
                                           len(seq_ids), step_id)
    num_scheduled = np.ones(len(seq_ids), dtype=np.int64)
    if len(multi_idx):
        if np.any(multi_cnt < 2):
            raise InvalidStepError(f"step {step_id}: multi_token_counts must be at least 2 (one is the default)")
        num_scheduled[multi_idx] = multi_cnt
    block_idx, block_cnt = _sparse_indices("new_block", cached.new_block_indices, cached.new_block_counts,
                                           len(seq_ids), step_id)
    block_ids = np.array(cached.new_block_ids, dtype=np.int64) if cached.new_block_ids else np.empty(0, np.int64)
    if (len(block_cnt) or len(block_ids)) and (np.any(block_cnt < 1) or int(block_cnt.sum()) != len(block_ids)):
        raise InvalidStepError(f"step {step_id}: new_block_counts (sum {int(block_cnt.sum())}) must be positive "
                               f"and add up to the {len(block_ids)} new_block_ids")
    num_drafts = None
    if len(cached.draft_indices) or len(cached.draft_counts):
        draft_idx, draft_cnt = _sparse_indices("draft", cached.draft_indices, cached.draft_counts, len(seq_ids),
                                               step_id)
        if np.any(draft_cnt < 1):
            raise InvalidStepError(f"step {step_id}: draft_counts must be positive")
        num_drafts = np.zeros(len(seq_ids), dtype=np.int64)
        num_drafts[draft_idx] = draft_cnt
    return StepInput(step_id, list(req.finished_seq_ids), new_requests, seq_ids, num_scheduled,
                     block_idx, block_cnt, block_ids, num_drafts, req.propose_drafts)


def _top_to_proto(top: TopLogprobs, msg: top_logprobs_pb2.TopLogprobColumns) -> None:
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
        token_counts=output.token_counts or (),
        num_drafts=output.num_drafts or (),
        verified_drafts=output.verified_drafts or (),
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


def build_worker_info(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name != "features"}
    return worker_pb2.WorkerInfo(**fields, features=[worker_pb2.Feature(name=f.name, available=f.available,
                                                                        detail=f.detail) for f in info.features])
