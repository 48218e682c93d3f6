"""Test-side helpers over the generated public stubs."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc


@dataclass
class Completion:
    """One sample's output (sample 0's for a request of n > 1, with every sample in `samples`)."""
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: int = 0
    usage: generation_pb2.Usage | None = None
    num_messages: int = 0
    matched_stop: str = ""
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    samples: list["Completion"] = field(default_factory=list)


def _tops(tops) -> list[tuple[list[int], list[float]]]:
    return [(list(t.token_ids), list(t.logprobs)) for t in tops]


def generate(channel: grpc.Channel, *, text: str | None = None, token_ids: list[int] | None = None,
             timeout: float = 240.0, request_id: str = "", **sampling) -> Completion:
    """Runs one Generate stream to its end and gathers what it said, per sample (the deadline leaves
    room for a first grammar, whose niced compiling child takes minutes to start on a busy machine)."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    req = generation_pb2.GenerateRequest(request_id=request_id, sampling=generation_pb2.SamplingParams(**sampling))
    if text is not None:
        req.text = text
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    samples: dict[int, Completion] = {}
    for msg in stub.Generate(req, timeout=timeout):
        out = samples.setdefault(msg.index, Completion())
        out.request_id = msg.request_id
        out.token_ids += msg.token_ids
        out.text += msg.text
        out.logprobs += msg.logprobs
        out.top_logprobs += _tops(msg.top_logprobs)
        out.prompt_logprobs += msg.prompt_logprobs
        out.prompt_top_logprobs += _tops(msg.prompt_top_logprobs)
        out.num_messages += 1
        if msg.finish_reason:
            out.finish_reason = msg.finish_reason
            out.usage = msg.usage
            out.matched_stop = msg.matched_stop
    first = samples.get(0, Completion())
    first.samples = [samples[i] for i in sorted(samples)]
    return first


def generate_many(channel: grpc.Channel, requests: list[dict], max_workers: int = 32) -> list[Completion]:
    """Sends all requests concurrently (one stream each) and returns completions in order."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda r: generate(channel, **r), requests))


def model_info(channel: grpc.Channel) -> generation_pb2.ModelInfo:
    return generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
