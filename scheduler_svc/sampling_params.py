"""Validated, resolved sampling parameters of one request (the scheduler's own copy)."""
from __future__ import annotations

from dataclasses import dataclass

from common.pb.llm.worker.v1 import worker_pb2


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0          # 0: greedy
    top_p: float = 1.0                # 1: off
    top_k: int = 0                    # 0: off
    min_p: float = 0.0                # 0: off
    seed: int | None = None
    max_tokens: int = 16              # resolved at admission: never past max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()   # a set: the scheduler tests every sampled token
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    skip_special_tokens: bool = False

    def __post_init__(self) -> None:
        # Any iterable of ids is accepted (frozenset() of a frozenset returns it as is).
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))

    def to_worker_options(self) -> worker_pb2.SamplingOptions:
        """What the worker's sampler needs; stop conditions stay with the scheduler."""
        options = worker_pb2.SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.logprobs,
        )
        if self.seed is not None:
            options.seed = self.seed
        return options
