"""The persistent batch: one row per request the worker holds, kept across steps.

Per-row facts live in host arrays indexed by row (vLLM V1's InputBatch): known token ids, how
many tokens are known and computed, the block table, sampling options. A step names its
requests by seq_id; `rows_of` turns those into row indices once, and everything after that is
vectorised over rows: validation, positions, slot mapping, sequence lengths, the block-table
gather. Python work per step is O(batch), and only new requests and block appends touch rows
one by one.

Tokens the worker samples are not written back here: their values stay on the device (the
runner keeps each row's newest sampled token there), so step N+1 can be prepared and launched
before step N's tokens reach the host. A row therefore knows its tokens on the host up to
`num_host_tokens` (what the scheduler sent) and counts, in `num_tokens`, the sampled ones too;
a decode's input is always the newest sampled token, gathered on the device.

What only some requests ask for (a grammar matcher, top logprobs, prompt scoring) is counted over
the rows, so a step whose batch asks for none of it learns so in O(1) and does no work for it.

Speculative decoding keeps, per row, the draft tokens proposed for its next step (`num_drafts` of
them; their values in `draft_tokens` when the proposer works on the host) and a generation that
changes whenever the row changes hands, so a step's late bookkeeping never lands on a new occupant.
"""
from __future__ import annotations

import numpy as np

from worker_svc.layers.sampler import SamplingOptions
from worker_svc.row_pool import grown_capacity
from worker_svc.runner_io import NewRequest


class InputBatch:
    def __init__(self, max_model_len: int, max_blocks_per_seq: int, initial_rows: int = 64,
                 max_drafts: int = 0) -> None:
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = max_blocks_per_seq
        self.row_of: dict[int, int] = {}         # seq_id -> row
        self._free_rows: list[int] = []
        self._num_rows = 0                       # rows ever handed out
        self.token_ids = np.zeros((initial_rows, max_model_len), dtype=np.int32)
        self.block_tables = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_host_tokens = np.zeros(initial_rows, dtype=np.int64)   # token values known here
        self.num_tokens = np.zeros(initial_rows, dtype=np.int64)        # known + sampled since
        self.num_computed = np.zeros(initial_rows, dtype=np.int64)      # K/V in the cache
        self.num_prompt = np.zeros(initial_rows, dtype=np.int64)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int64)
        self.options: list[SamplingOptions | None] = [None] * initial_rows
        self.penalty_rows: list[int | None] = [None] * initial_rows
        self.seq_id_of = np.zeros(initial_rows, dtype=np.int64)
        self.matchers: list = [None] * initial_rows                       # GrammarMatcher, rank 0 only
        self.constrained = np.zeros(initial_rows, dtype=bool)             # has a matcher
        self.top_logprobs = np.zeros(initial_rows, dtype=np.int64)        # 0: none asked
        self.scores_prompt = np.zeros(initial_rows, dtype=bool)           # prompt tokens still to score
        self.num_drafts = np.zeros(initial_rows, dtype=np.int64)          # drafts held for the next step
        self.draft_tokens = np.zeros((initial_rows, max(max_drafts, 1)), dtype=np.int64)
        # A proposer on the device skipped a step of the row (the batch was past the threshold):
        # its cache lacks those positions, so the row gets no drafts from it again.
        self.drafter_behind = np.zeros(initial_rows, dtype=bool)
        self.generation = np.zeros(initial_rows, dtype=np.int64)          # bumped when the row changes hands
        self.num_constrained = self.num_top_logprobs = self.num_scoring = 0
        # Bumped whenever a row changes hands, so cached per-row-set data (the sampler's
        # metadata) is rebuilt exactly when the batch changes.
        self.version = 0

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.row_of

    @property
    def capacity(self) -> int:
        return len(self.num_tokens)

    def seq_ids(self) -> list[int]:
        return list(self.row_of)

    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """Row indices of the given requests; KeyError names the first one not held."""
        row_of = self.row_of
        return np.fromiter((row_of[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))

    def add(self, new: NewRequest, penalty_row: int | None, matcher=None) -> int:
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self._num_rows
            self._num_rows += 1
            if row >= self.capacity:
                self._grow(grown_capacity(self.capacity, row + 1))
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_host_tokens[row] = self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_prompt[row] = new.num_prompt_tokens
        self.block_tables[row, :len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        self.options[row] = new.sampling
        self.penalty_rows[row] = penalty_row
        self.row_of[new.seq_id] = row
        self.seq_id_of[row] = new.seq_id
        self.matchers[row] = matcher
        self.constrained[row] = matcher is not None
        self.num_constrained += int(matcher is not None)
        self.top_logprobs[row] = new.sampling.top_logprobs
        self.num_top_logprobs += int(new.sampling.top_logprobs > 0)
        # Scored while chunks compute positions before the last prompt token.
        scores = new.sampling.prompt_logprobs and new.num_computed_tokens < new.num_prompt_tokens - 1
        self.scores_prompt[row] = scores
        self.num_scoring += int(scores)
        self.num_drafts[row] = 0
        self.drafter_behind[row] = False
        self.generation[row] += 1
        self.version += 1
        return row

    def prompt_scored(self, row: int) -> None:
        """The row's prompt is scored to its end."""
        if self.scores_prompt[row]:
            self.scores_prompt[row] = False
            self.num_scoring -= 1

    def remove(self, seq_id: int) -> int | None:
        """Frees the request's row; returns its penalty row (for the sampler to release)."""
        row = self.row_of.pop(seq_id)
        # The attention contract pads block tables with 0 past their end.
        self.block_tables[row, :self.num_blocks[row]] = 0
        penalty_row = self.penalty_rows[row]
        self.options[row] = self.penalty_rows[row] = None
        self.num_constrained -= int(self.matchers[row] is not None)
        self.matchers[row] = None
        self.constrained[row] = False
        self.num_top_logprobs -= int(self.top_logprobs[row] > 0)
        self.top_logprobs[row] = 0
        self.prompt_scored(row)
        self.num_drafts[row] = 0
        self.generation[row] += 1
        self._free_rows.append(row)
        self.version += 1
        return penalty_row

    def append_blocks(self, rows: np.ndarray, indices: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        """Appends counts[i] ids of block_ids (concatenated) to row rows[indices[i]]."""
        offset = 0
        for index, count in zip(indices.tolist(), counts.tolist()):
            row = rows[index]
            start = self.num_blocks[row]
            self.block_tables[row, start:start + count] = block_ids[offset:offset + count]
            self.num_blocks[row] = start + count
            offset += count

    def _grow(self, capacity: int) -> None:
        def grown(array: np.ndarray) -> np.ndarray:
            out = np.zeros((capacity, *array.shape[1:]), dtype=array.dtype)
            out[:len(array)] = array
            return out

        for name in ("token_ids", "block_tables", "num_host_tokens", "num_tokens", "num_computed", "num_prompt",
                     "num_blocks", "seq_id_of", "constrained", "top_logprobs", "scores_prompt", "num_drafts",
                     "draft_tokens", "drafter_behind", "generation"):
            setattr(self, name, grown(getattr(self, name)))
        extra = capacity - len(self.options)
        self.options += [None] * extra
        self.penalty_rows += [None] * extra
        self.matchers += [None] * extra
