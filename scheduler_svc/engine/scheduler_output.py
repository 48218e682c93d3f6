"""What one scheduled step is, as the scheduler hands it to the step message and reads it back in
update(): the step's columns in batch order (SchedulerOutput), the new requests copied at schedule
time, and read-back views of single entries for tests and logs."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling import SamplingParams
from scheduler_svc.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the worker does not hold yet: everything it needs, copied at schedule
    time so later appends to the sequence cannot change what this step says."""
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list[int]
    sampling: SamplingParams


@dataclass(slots=True)
class CachedColumns:
    """The requests the worker holds, field for field as worker.v1 CachedRequests carries them
    (its comments say what each means): entry i of seq_ids is one request, and only the
    exceptions are listed, by index into seq_ids (ascending): multi-token chunks, block growth
    (the ids concatenated) and draft verification."""
    seq_ids: list[int] = field(default_factory=list)
    multi_token_indices: list[int] = field(default_factory=list)
    multi_token_counts: list[int] = field(default_factory=list)
    new_block_indices: list[int] = field(default_factory=list)
    new_block_counts: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    draft_indices: list[int] = field(default_factory=list)
    draft_counts: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """One cached request read back from the output's columns (a view for tests and logs)."""
    seq_id: int
    num_scheduled_tokens: int
    new_block_ids: list[int]


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One scheduled sequence read back from the output's columns (a view for tests)."""
    seq: Sequence
    num_scheduled_tokens: int
    num_computed_tokens: int     # before this step
    samples: bool                # the step reaches the end of its tokens: it samples one
    num_admissions: int


@dataclass(eq=False)             # compared by identity: the scheduler tracks outputs in flight
class SchedulerOutput:
    """One step, as columns in batch order: the requests the worker holds (cached) first, in
    the order of the running list, then the ones it does not (new). Index i of `seqs`,
    `num_scheduled`, `num_computed` and `admissions` is one scheduled sequence; for i below
    len(cached.seq_ids) it is also entry i of the cached columns.

    A decode-heavy step is mostly sequences computing one token and getting no block, so the
    columns list only the exceptions (multi-token chunks, block growth); the step message
    copies them to the wire as they are."""
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)      # before this step
    # The admission each entry belongs to: update() ignores an entry whose sequence was
    # finished, preempted or reset since.
    admissions: list[int] = field(default_factory=list)
    # The sequences that sample one token in this step, in batch order: the worker's reply
    # holds one token for each, in this order.
    sampling_seqs: list[Sequence] = field(default_factory=list)
    sampling_admissions: list[int] = field(default_factory=list)
    cached: CachedColumns = field(default_factory=CachedColumns)
    # The entries of cached.draft_indices by position in sampling_seqs, for update().
    sampling_draft_indices: list[int] = field(default_factory=list)
    propose_drafts: bool = False   # the worker proposes drafts for the next step
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)    # finished or aborted
    preempted_seq_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: int = 0      # drafts included
    # Set by update(): tokens each received sequence got (None: one each, in the usual case), and
    # the drafts verified and accepted for sequences still running.
    received_counts: list[int] | None = None
    num_verifications: int = 0         # sequences that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    _entry_of: dict[int, int] | None = field(default=None, init=False, repr=False)   # id(seq) -> index

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def shift_positions(self, seq: Sequence, by: int) -> None:
        """seq's entry starts `by` positions later than scheduled: a verification in flight before
        this step accepted that many drafts (the worker computes this step's positions itself)."""
        if self._entry_of is None:   # once per step: every verifying sequence of the step before asks
            self._entry_of = {id(s): i for i, s in enumerate(self.seqs)}
        i = self._entry_of.get(id(seq))
        if i is not None:
            self.num_computed[i] += by

    @property
    def scheduled(self) -> list[ScheduledSequence]:
        sampling = {id(s) for s in self.sampling_seqs}
        return [ScheduledSequence(seq, n, c, id(seq) in sampling, a)
                for seq, n, c, a in zip(self.seqs, self.num_scheduled, self.num_computed, self.admissions)]

    @property
    def cached_requests(self) -> list[CachedRequestData]:
        cached = self.cached
        counts = dict(zip(cached.multi_token_indices, cached.multi_token_counts))
        blocks, offset = {}, 0
        for index, count in zip(cached.new_block_indices, cached.new_block_counts):
            blocks[index] = cached.new_block_ids[offset:offset + count]
            offset += count
        return [CachedRequestData(seq_id, counts.get(i, 1), blocks.get(i, []))
                for i, seq_id in enumerate(cached.seq_ids)]

    @property
    def num_drafts(self) -> dict[int, int]:
        """Drafts verified per cached entry that has any (a view for tests and logs)."""
        return dict(zip(self.cached.draft_indices, self.cached.draft_counts))
