"""A decode step staged in the decode graphs' layout (worker_svc/graph_inputs.py) unpacks into the
graphs' static inputs: host-known ids kept, the others read from each row's newest sampled token,
int32 lengths and block tables, and padding rows made inert. Runs under Triton's interpreter
without CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.triton_interpreter import DEVICE, gpu_faithful
from worker_svc.graph_inputs import DecodeInputs, DecodeLayout


@pytest.fixture(scope="module", autouse=True)
def interpreted_like_a_gpu():
    with gpu_faithful():
        yield


def test_a_staged_decode_step_unpacks_into_the_static_inputs_with_inert_padding():
    layout, max_blocks, padded = DecodeLayout(max_batch=8), 6, 5
    last_sampled = torch.arange(100, 120, device=DEVICE)   # row r's newest token: 100 + r
    inputs = DecodeInputs(torch.zeros(1024, dtype=torch.int64, device=DEVICE), layout, last_sampled, dummy_row=19)
    n, width = 3, 2
    tables = np.array([[4, 5], [6, 0], [7, 8]])
    parts = [layout.header(n, width), np.array([-1, 42, -1]), np.array([30, 7, 16]), np.array([78, 97, 129]),
             np.array([31, 8, 17]), np.array([2, 9, 4]), tables.reshape(-1)]
    for part, offset in zip(parts, layout.offsets(n, width)):   # what the staging copy leaves there
        inputs.staged[offset:offset + len(part)] = torch.from_numpy(part)
    with torch.device(DEVICE):
        ids, positions = torch.full((8,), -5), torch.full((8,), -5)
        slots, seq_lens, rows = torch.full((8,), -5), torch.full((8,), -5, dtype=torch.int32), torch.full((8,), -5)
        block_tables = torch.full((8, max_blocks), 99, dtype=torch.int32)
    inputs.unpack(padded, ids, positions, slots, seq_lens, rows, block_tables)
    assert ids[:padded].tolist() == [102, 42, 104, 0, 0]
    assert positions[:padded].tolist() == [30, 7, 16, 0, 0]
    assert slots[:padded].tolist() == [78, 97, 129, -1, -1]
    assert seq_lens[:padded].tolist() == [31, 8, 17, 0, 0]
    assert rows[:padded].tolist() == [2, 9, 4, 19, 19]
    assert block_tables[:n, :width].tolist() == tables.tolist()
    assert (block_tables[:, width:] == 99).all() and (block_tables[n:] == 99).all()   # nothing reads past seq_len
    assert ids[padded:].tolist() == [-5] * 3   # past the graph's size: untouched
