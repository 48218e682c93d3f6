"""One request as the scheduler sees it: its tokens, its KV block table and where it stands."""
from __future__ import annotations

import enum
import itertools
import time

from common.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # queued, never admitted yet
    RUNNING = "running"        # holds KV blocks; scheduled every step until it finishes
    PREEMPTED = "preempted"    # its blocks were taken back; waits to be recomputed
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"              # EOS, a stop token id or a stop string
    LENGTH = "length"          # max_tokens or max_model_len
    ABORT = "abort"


# Orders requests of equal priority by arrival, across the whole process (a request may move
# between worker groups' schedulers and keeps its place).
_arrivals = itertools.count()


class Sequence:
    """The scheduler's source of truth for one request: it always holds every token, so a
    worker's copy can be rebuilt from it (after preemption or a worker restart)."""

    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "num_cached_prompt_tokens", "block_table", "block_hashes", "status", "finish_reason",
        "sampling", "arrival_time", "num_admissions", "on_worker", "num_blocks_on_worker",
        "num_placeholder_tokens", "arrival_order", "paused", "suspect", "num_failures", "num_drafts",
        "num_unresolved_drafts",
    )

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingParams, arrival_time: float | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt, then output so far
        self.num_prompt_tokens = len(self.token_ids)
        # Tokens whose KV is in the cache or being computed by a step sent to the worker: a
        # step counts its tokens as computed when it is scheduled, since the worker runs steps
        # in order and a later step can rely on them.
        self.num_computed_tokens = 0
        # Tokens that steps in flight will sample: counted as known for scheduling (so the next
        # step can already name the decode of one) but not in token_ids, which holds only real
        # tokens. At most one per step in flight.
        self.num_placeholder_tokens = 0
        self.num_cached_prompt_tokens = 0     # prefix-cache hit at the first admission (Usage)
        self.block_table: list[int] = []
        # Chained hashes of the full blocks of token_ids, filled lazily by the block manager.
        # Tokens are only ever appended, so they stay valid for the sequence's whole life and
        # each block is hashed once, however often the sequence is preempted.
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.sampling = sampling
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = next(_arrivals)
        # Bumped on every admission, so a step result that belongs to an earlier admission
        # (the sequence was preempted or reset meanwhile) is recognised as stale.
        self.num_admissions = 0
        # Whether the worker mirrors this sequence (then a step sends only diffs), and how
        # many of block_table's ids it already has.
        self.on_worker = False
        self.num_blocks_on_worker = 0
        # Its client reads slower than it is generated (backpressure): out of the batch until
        # resumed, keeping its blocks unless someone needs them (Scheduler.pause says how).
        self.paused = False
        # It was in a step that failed and has not been in a step that succeeded since: it is
        # re-admitted alone (no other suspect running), so that the next failure is its own
        # (num_failures counts those; GroupRunner fails it at --max-request-failures).
        self.suspect = False
        self.num_failures = 0
        # Draft tokens its worker mirror holds for its next decode to verify (speculative decoding):
        # what the last answer said, or, while a step in flight proposes for it, the most that
        # step may propose (the worker verifies those it holds, up to the count asked).
        self.num_drafts = 0
        # Drafts that steps in flight verify: each may be accepted, so their positions are
        # reserved (KV slots, max_tokens) until the answer says how many were.
        self.num_unresolved_drafts = 0

    @property
    def priority(self) -> int:
        """Lower is served first."""
        return self.sampling.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled (the
        placeholders of steps in flight included: their decode comes next)."""
        return len(self.token_ids) + self.num_placeholder_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token left to compute: the prompt (or, after a preemption, the whole
        history) is not in the cache yet. A decode computes exactly the last sampled token."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
                f"status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, placeholders={self.num_placeholder_tokens}, "
                f"blocks={len(self.block_table)})")
