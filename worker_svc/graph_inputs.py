"""A pure-decode step's inputs in the fixed layout its CUDA graph reads, and the kernel that
unpacks them inside the graph.

The host writes a decode step's columns at fixed offsets of the staging buffer (staging.py), so
the step's one host-to-device copy lands where the captured graphs look, and nothing else runs
on the device before the replay. The graph's first kernel turns the columns into the forward's
static inputs: the input ids (a row's newest sampled token, read on the device, where the host
has none), positions, slots, int32 sequence lengths and block tables, and the rows that sample;
rows past the step's n are padding made inert (slot -1, length 0, the sampler's dummy row).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

HEADER = 8            # the step's n and block-table width, then room
TABLE_BLOCK = 128     # block-table columns per step of the unpack loop


@dataclass(frozen=True)
class DecodeLayout:
    """Where each column of a decode step of up to `max_batch` requests lies in the staging buffer
    (int64 entries): the header, then input ids (-1: the row's newest sampled token), positions,
    slots, sequence lengths and rows, `max_batch` entries each, then the block tables, n x width."""
    max_batch: int

    def offsets(self, n: int, width: int) -> list[int]:
        """Offsets of [header, ids, positions, slots, seq_lens, rows, tables, what follows]."""
        m = self.max_batch
        return [0, HEADER, HEADER + m, HEADER + 2 * m, HEADER + 3 * m, HEADER + 4 * m, HEADER + 5 * m,
                HEADER + 5 * m + n * width]

    def header(self, n: int, width: int) -> np.ndarray:
        return np.array([n, width], np.int64)


@triton.jit
def _unpack_kernel(staged_ptr, last_sampled_ptr, ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr, rows_ptr,
                   tables_ptr, table_stride, max_batch, dummy_row, HEADER_SIZE: tl.constexpr,
                   TABLE_BLOCK_SIZE: tl.constexpr):
    i = tl.program_id(0)
    n = tl.load(staged_ptr)
    if i < n:
        width = tl.load(staged_ptr + 1)
        column = staged_ptr + HEADER_SIZE + i
        token = tl.load(column)
        row = tl.load(column + 4 * max_batch)
        if token < 0:
            token = tl.load(last_sampled_ptr + row)
        tl.store(ids_ptr + i, token)
        tl.store(positions_ptr + i, tl.load(column + max_batch))
        tl.store(slots_ptr + i, tl.load(column + 2 * max_batch))
        tl.store(seq_lens_ptr + i, tl.load(column + 3 * max_batch).to(tl.int32))
        tl.store(rows_ptr + i, row)
        table = staged_ptr + HEADER_SIZE + 5 * max_batch + i * width
        for start in range(0, width, TABLE_BLOCK_SIZE):
            cols = start + tl.arange(0, TABLE_BLOCK_SIZE)
            blocks = tl.load(table + cols, mask=cols < width, other=0)
            tl.store(tables_ptr + i * table_stride + cols, blocks.to(tl.int32), mask=cols < width)
    else:
        tl.store(ids_ptr + i, 0)
        tl.store(positions_ptr + i, 0)
        tl.store(slots_ptr + i, -1)
        tl.store(seq_lens_ptr + i, 0)
        tl.store(rows_ptr + i, dummy_row)


class DecodeInputs:
    """The staged columns of decode steps (a view of the staging buffer's device side), the
    tensor of each row's newest sampled token, and the sampler's dummy row for padding."""

    def __init__(self, staged: torch.Tensor, layout: DecodeLayout, last_sampled: torch.Tensor, dummy_row: int) -> None:
        self.staged, self.layout, self.last_sampled, self.dummy_row = staged, layout, last_sampled, dummy_row
        self.staged[:HEADER].zero_()   # n = 0 until a step is staged: capture's warm-up runs on padding

    def unpack(self, batch_size: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               seq_lens: torch.Tensor, rows: torch.Tensor, block_tables: torch.Tensor) -> None:
        """Writes the first batch_size entries of the static inputs from the staged columns."""
        _unpack_kernel[(batch_size,)](
            self.staged, self.last_sampled, ids, positions, slots, seq_lens, rows, block_tables,
            block_tables.stride(0), self.layout.max_batch, self.dummy_row, HEADER_SIZE=HEADER,
            TABLE_BLOCK_SIZE=TABLE_BLOCK, num_warps=1)
