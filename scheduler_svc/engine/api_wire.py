"""llm.engine.v1 messages to and from scheduler_svc.engine.api: the one codec of the core/frontend
wire, used by the core's server and the frontends' client alike."""
from __future__ import annotations

from common.pb.llm.common.v1 import top_logprobs_pb2
from common.pb.llm.engine.v1 import engine_pb2 as pb
from common.features import Feature
from common.record_codec import decode, encode
from common.sampling import SamplingParams
from scheduler_svc.engine.api import (AddCode, AddResult, CoreEvent, CoreInfo, CoreRequest, CoreStatus,
                                      FinishedRequest, GroupState, PromptLogprobs, RequestError, StepOutputs,
                                      TopLogprobColumns)
from scheduler_svc.engine.sequence import FinishReason

_REASON_TO_PB = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                 FinishReason.ABORT: pb.FINISH_REASON_ABORT}
_REASON_FROM_PB = {v: k for k, v in _REASON_TO_PB.items()}


def reason_to_pb(reason: FinishReason) -> int:
    return _REASON_TO_PB[reason]


def reason_from_pb(value: int) -> FinishReason:
    return _REASON_FROM_PB.get(value, FinishReason.ABORT)


# -- requests ---------------------------------------------------------------------------------
def add_requests_to_pb(requests: list[CoreRequest]) -> pb.AddRequestsRequest:
    msg = pb.AddRequestsRequest()
    for r in requests:
        new = msg.requests.add(seq_id=r.seq_id, request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                               sample_index=r.sample_index)
        encode(r.sampling, new.sampling)
    return msg


def add_requests_from_pb(msg: pb.AddRequestsRequest) -> list[CoreRequest]:
    return [CoreRequest(r.seq_id, r.request_id, list(r.prompt_token_ids), decode(r.sampling, SamplingParams),
                        r.sample_index)
            for r in msg.requests]


def add_results_to_pb(results: list[AddResult]) -> pb.AddRequestsResponse:
    return pb.AddRequestsResponse(results=[pb.AddResult(code=int(r.code), message=r.message) for r in results])


def add_results_from_pb(msg: pb.AddRequestsResponse) -> list[AddResult]:
    return [AddResult(AddCode(r.code), r.message) for r in msg.results]


# -- events -----------------------------------------------------------------------------------
def status_to_pb(s: CoreStatus) -> pb.CoreStatus:
    return pb.CoreStatus(accepting=s.accepting, reason=s.reason, max_model_len=s.max_model_len,
                         features=[pb.Feature(name=f.name, available=f.available, detail=f.detail)
                                   for f in s.features])


def status_from_pb(msg: pb.CoreStatus) -> CoreStatus:
    return CoreStatus(msg.accepting, msg.reason, msg.max_model_len,
                      tuple(Feature(f.name, f.available, f.detail) for f in msg.features))


def event_to_pb(event: CoreEvent) -> pb.CoreEvent:
    msg = pb.CoreEvent()
    if event.status is not None:
        msg.status.CopyFrom(status_to_pb(event.status))
    out = event.outputs
    if out is not None:
        msg.outputs.seq_ids.extend(out.seq_ids)
        msg.outputs.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            msg.outputs.logprobs.extend(out.logprobs)
        for f in out.finished:
            finished = msg.outputs.finished.add(seq_id=f.seq_id, reason=_REASON_TO_PB[f.reason],
                                                num_output_tokens=f.num_output_tokens,
                                                num_cached_prompt_tokens=f.num_cached_prompt_tokens)
            if f.error is not None:
                finished.error_code, finished.error_message = f.error.code, f.error.message
                finished.error_about_constraint = f.error.about_constraint
        if out.top_logprobs is not None:
            _top_to_pb(out.top_logprobs, msg.outputs.top_logprobs)
        prompt = out.prompt_logprobs
        if prompt is not None:
            target = msg.outputs.prompt_logprobs
            target.seq_ids.extend(prompt.seq_ids)
            target.counts.extend(prompt.counts)
            target.logprobs.extend(prompt.logprobs)
            if prompt.top is not None:
                _top_to_pb(prompt.top, target.top)
    return msg


def _error_from_pb(f: pb.FinishedRequest) -> RequestError | None:
    if not f.error_code:
        return None
    return RequestError(f.error_code, f.error_message, f.error_about_constraint)


def _top_to_pb(top: TopLogprobColumns, msg: top_logprobs_pb2.TopLogprobColumns) -> None:
    msg.counts.extend(top.counts)
    msg.token_ids.extend(top.token_ids)
    msg.logprobs.extend(top.logprobs)


def _top_from_pb(msg: top_logprobs_pb2.TopLogprobColumns) -> TopLogprobColumns | None:
    if not len(msg.counts):
        return None
    return TopLogprobColumns(list(msg.counts), list(msg.token_ids), list(msg.logprobs))


def event_from_pb(msg: pb.CoreEvent) -> CoreEvent:
    event = CoreEvent()
    if msg.HasField("status"):
        event.status = status_from_pb(msg.status)
    if msg.HasField("outputs"):
        out = msg.outputs
        event.outputs = StepOutputs(
            seq_ids=list(out.seq_ids), token_ids=list(out.token_ids),
            logprobs=list(out.logprobs) if len(out.logprobs) else None,
            finished=[FinishedRequest(f.seq_id, reason_from_pb(f.reason), f.num_output_tokens,
                                      f.num_cached_prompt_tokens, _error_from_pb(f)) for f in out.finished],
            top_logprobs=_top_from_pb(out.top_logprobs))
        if len(out.prompt_logprobs.seq_ids):
            p = out.prompt_logprobs
            event.outputs.prompt_logprobs = PromptLogprobs(list(p.seq_ids), list(p.counts), list(p.logprobs),
                                                           _top_from_pb(p.top))
    return event


# -- state ------------------------------------------------------------------------------------
def info_to_pb(info: CoreInfo) -> pb.CoreInfo:
    return pb.CoreInfo(status=status_to_pb(info.status), groups=[
        pb.WorkerGroupState(
            addresses=g.addresses, healthy=g.healthy, num_kv_blocks=g.num_kv_blocks,
            num_free_kv_blocks=g.num_free_kv_blocks, num_running=g.num_running, num_waiting=g.num_waiting,
            device=g.device, attention_backend=g.attention_backend, num_preemptions=g.num_preemptions,
            prefix_cache_queried_tokens=g.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=g.prefix_cache_hit_tokens, block_size=g.block_size, max_model_len=g.max_model_len,
            num_paused=g.num_paused, kv_cache_dtype=g.kv_cache_dtype, speculative_method=g.speculative_method,
            num_speculative_tokens=g.num_speculative_tokens)
        for g in info.groups])


def info_from_pb(msg: pb.CoreInfo) -> CoreInfo:
    return CoreInfo(status_from_pb(msg.status), [
        GroupState(list(g.addresses), g.healthy, g.num_kv_blocks, g.num_free_kv_blocks, g.num_running, g.num_waiting,
                   g.device, g.attention_backend, g.num_preemptions, g.prefix_cache_queried_tokens,
                   g.prefix_cache_hit_tokens, g.block_size, g.max_model_len, g.num_paused, g.kv_cache_dtype,
                   g.speculative_method, g.num_speculative_tokens)
        for g in msg.groups])
