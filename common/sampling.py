"""Validated, resolved sampling parameters of one request (the scheduler's own copy).

`n` is the frontend's business: it admits n sequences, each with the parameters of one sample
(`for_sample`), so the core, the scheduler and the workers only ever see single sequences.
"""
from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import xxhash

from common.constraint import Constraint
from common.pb.llm.worker.v1 import worker_pb2

MAX_N = 16
MAX_TOP_LOGPROBS = 20


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for sample 0
    (so n = 1 and sample 0 of n > 1 draw the same tokens), a hash of (seed, index) for the others."""
    if index == 0:
        return seed
    return xxhash.xxh64_intdigest(struct.pack("<QQ", seed & 0xFFFF_FFFF_FFFF_FFFF, index))


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
    n: int = 1                        # samples; the frontend fans them out
    top_logprobs: int = 0             # 0..MAX_TOP_LOGPROBS; > 0 implies logprobs
    prompt_logprobs: bool = False
    constraint: Constraint | None = None
    priority: int = 0                 # lower first
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias), ids ascending, no zero bias

    def __post_init__(self) -> None:
        # Any iterable of ids is accepted (frozenset() of a frozenset returns it as is).
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` as one sequence: its own seed, and prompt logprobs
        only for sample 0 (the prompt is the same for all)."""
        if self.n == 1:
            return self
        seed = sample_seed(self.seed, index) if self.seed is not None else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs and index == 0)

    def to_worker_options(self, *, prompt_logprobs: bool | None = None) -> worker_pb2.SamplingOptions:
        """What the worker's sampler needs; stop conditions stay with the scheduler.
        `prompt_logprobs` overrides the request's (a re-sent request whose prompt was scored)."""
        options = worker_pb2.SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        )
        if self.seed is not None:
            options.seed = self.seed
        if self.logit_bias:
            options.logit_bias_token_ids.extend(t for t, _ in self.logit_bias)
            options.logit_bias_values.extend(v for _, v in self.logit_bias)
        return options
