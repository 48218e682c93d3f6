"""Validated, resolved sampling parameters of one request (the scheduler's own copy).

`n` is the frontend's business: it admits n sequences, each with the parameters of one sample
(`for_sample`), so the core, the scheduler and the workers only ever see single sequences. The
internal wires carry these fields by name (common/record_codec.py); a default here is what an
unset field on them means. Bounds: common/sampling_bounds.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.constraint import Constraint
from common.sampling_bounds import sample_seed


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
    top_logprobs: int = 0             # > 0 implies logprobs
    prompt_logprobs: bool = False
    constraint: Constraint | None = None
    priority: int = 0                 # lower first
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias), ids ascending, no zero bias
    speculative: bool = True          # speculative decoding may serve it (where configured)

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
