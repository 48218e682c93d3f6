"""The worker's mirror of every running request, kept in step with the scheduler's.

Token ids arrive once (NewRequest) and grow by the tokens the worker samples; block tables
arrive once and grow by the ids each step appends. Block tables live as rows of one array so a
step gathers its batch's rows in one vectorised copy instead of rebuilding lists.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker_svc.layers.sampler import SamplingOptions
from worker_svc.row_pool import RowPool, grown_capacity


@dataclass(slots=True)
class RequestState:
    seq_id: int
    token_ids: list[int]            # prompt, then every output token so far
    num_prompt_tokens: int
    num_computed_tokens: int        # tokens whose K/V are in the cache
    num_blocks: int                 # entries of its block-table row in use
    row: int                        # its row in RequestMirror.block_tables
    sampling: SamplingOptions
    penalty_row: int | None         # its row in the sampler's penalty table

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class RequestMirror:
    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_tables = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self._rows = RowPool()
        self._requests: dict[int, RequestState] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, seq_id: int) -> RequestState:
        return self._requests[seq_id]

    def add(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, num_computed_tokens: int,
            block_ids: list[int], sampling: SamplingOptions, penalty_row: int | None) -> RequestState:
        row = self._rows.acquire()
        self._ensure_capacity(self._rows.high_water)
        state = RequestState(seq_id, token_ids, num_prompt_tokens, num_computed_tokens, 0, row, sampling, penalty_row)
        self._requests[seq_id] = state
        self.append_blocks(state, block_ids)
        return state

    def append_blocks(self, state: RequestState, block_ids: list[int]) -> None:
        end = state.num_blocks + len(block_ids)
        self.block_tables[state.row, state.num_blocks:end] = block_ids
        state.num_blocks = end

    def remove(self, seq_id: int) -> RequestState:
        state = self._requests.pop(seq_id)
        # Zero the row: the attention contract pads block tables with 0 past their end.
        self.block_tables[state.row, :state.num_blocks] = 0
        self._rows.release(state.row)
        return state

    def seq_ids(self) -> list[int]:
        return list(self._requests)

    def _ensure_capacity(self, needed: int) -> None:
        capacity = self.block_tables.shape[0]
        if needed > capacity:
            grown = np.zeros((grown_capacity(capacity, needed), self.max_blocks_per_seq), dtype=np.int32)
            grown[:capacity] = self.block_tables
            self.block_tables = grown
