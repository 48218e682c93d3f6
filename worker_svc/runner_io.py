"""What the model runner takes and gives back, as plain data: a step (the cached requests as
columns, the new ones whole), the step's output, and the worker's description; and the errors
a step is refused with. worker_svc/step_message.py turns these into protobuf and back; nothing
here imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.features import Feature
from worker_svc.layers.sampler import SamplingOptions


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
    # Speculative decoding: the most drafts each cached request verifies after its decode token
    # (0: none; the step checks fit it to the drafts the worker holds), and whether to propose
    # drafts for the next step.
    num_drafts: np.ndarray | None = None    # int64 [len(cached_seq_ids)]; None: no drafts
    propose_drafts: bool = False

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
    # Speculative decoding: tokens per sampling request and the drafts each verified when the step
    # verified drafts (None: one each), and the drafts held for each for the next step when it
    # proposed (None: none).
    token_counts: list[int] | None = None
    num_drafts: list[int] | None = None
    verified_drafts: list[int] | None = None


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What this worker serves and the most a step may ask of it. The fields are WorkerInfo's
    in protos/llm/worker/v1/worker.proto, by name."""
    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    rank: int
    world_size: int
    device: str
    attention_backend: str
    dtype: str
    instance_id: str                # new at every start, so the scheduler notices a restart
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str             # "bfloat16", "float32", or "float8_e4m3fn" (an FP8 cache)
    features: tuple[Feature, ...] = ()   # the optional features and whether this worker serves each
    speculative_method: str = ""    # the proposer; empty: none
    num_speculative_tokens: int = 0
    max_held_requests: int = 0      # running and paused at once without turning the graphs off
