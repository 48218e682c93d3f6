"""What the engine core and its frontends say to each other, as plain data (the wire form is
llm.engine.v1, encoded and decoded in scheduler_svc/engine/api_wire.py; an in-process frontend passes
these objects as they are).

A frontend picks the seq_id of each request it adds: its frontend id in the top bits, a counter
below. So it can file the core's outputs before the core has even answered the add, and the core
knows, from a seq_id alone, which frontend a token goes to.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.features import Feature
from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import FinishReason

SEQ_ID_BITS = 40          # a frontend numbers up to 2**40 requests; ids stay below 2**63


def make_seq_id(frontend_id: int, counter: int) -> int:
    return (frontend_id << SEQ_ID_BITS) | counter


def frontend_of(seq_id: int) -> int:
    return seq_id >> SEQ_ID_BITS


@dataclass(slots=True)
class CoreRequest:
    seq_id: int
    request_id: str            # shared by the samples of one request (n > 1)
    prompt_token_ids: list[int]
    sampling: SamplingParams   # of this sample (SamplingParams.for_sample)
    sample_index: int = 0


class AddCode(enum.IntEnum):
    OK = 0
    ALREADY_EXISTS = 1         # the request_id is in flight
    RESOURCE_EXHAUSTED = 2     # the waiting queue is full
    UNAVAILABLE = 3            # no worker group is up, or the core is draining
    INVALID_ARGUMENT = 4       # e.g. longer than every group's context limit


@dataclass(frozen=True, slots=True)
class AddResult:
    code: AddCode
    message: str = ""


ADDED = AddResult(AddCode.OK)


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why a request failed (its grammar does not compile, it made the worker fail, ...): the gRPC
    status code name its client gets, and the message; a message `about_constraint` reads after
    the name of the request's constraint field ("is invalid: ...")."""
    code: str
    message: str
    about_constraint: bool = False


@dataclass(slots=True)
class FinishedRequest:
    seq_id: int
    reason: FinishReason
    num_output_tokens: int
    num_cached_prompt_tokens: int
    error: RequestError | None = None     # set when the request failed


@dataclass(slots=True)
class TopLogprobColumns:
    """The most likely tokens at several positions, packed: entry i is the next counts[i] values
    of token_ids and logprobs, most likely first (0 for a position whose request did not ask)."""
    counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def entries(self) -> list[tuple[list[int], list[float]]]:
        """(token ids, logprobs) of each position."""
        out, offset = [], 0
        for count in self.counts:
            out.append((self.token_ids[offset:offset + count], self.logprobs[offset:offset + count]))
            offset += count
        return out

    def append(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.counts.append(len(token_ids))
        self.token_ids += token_ids
        self.logprobs += logprobs


@dataclass(slots=True)
class PromptLogprobs:
    """Prompt tokens scored in one step: request seq_ids[i] has its next counts[i] tokens'
    logprobs (each continuing where the last step left off, from the prompt's second token)."""
    seq_ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: TopLogprobColumns | None = None         # one entry per scored token, when any asked


@dataclass(slots=True)
class StepOutputs:
    """One step's news for one frontend: prompt tokens scored, a token per entry (a request once
    per token it got, in order: several when speculative decoding accepted drafts), then the
    requests that ended in the step."""
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None          # parallel to token_ids when any request asked
    finished: list[FinishedRequest] = field(default_factory=list)
    top_logprobs: TopLogprobColumns | None = None   # parallel to token_ids when any request asked
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True, slots=True)
class CoreStatus:
    accepting: bool            # a worker group is up and the core is not draining
    reason: str                # why not, when not
    max_model_len: int         # of the groups up (0 while none has been)
    features: tuple[Feature, ...] = ()   # the optional features, as the workers can serve them


@dataclass(slots=True)
class CoreEvent:
    status: CoreStatus | None = None
    outputs: StepOutputs | None = None


@dataclass(frozen=True, slots=True)
class GroupState:
    addresses: list[str]
    healthy: bool
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_running: int
    num_waiting: int
    device: str
    attention_backend: str
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    block_size: int
    max_model_len: int
    num_paused: int = 0        # out of the batch until their clients read again
    kv_cache_dtype: str = ""   # the workers' WorkerInfo.kv_cache_dtype ("" while none is up)
    speculative_method: str = ""       # ngram, eagle3 or draft; empty: off
    num_speculative_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """One snapshot of the core's state: GetModelInfo and the metrics read it."""
    status: CoreStatus
    groups: list[GroupState]
