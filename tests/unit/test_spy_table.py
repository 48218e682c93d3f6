"""tools.spy_table reads py-spy's raw stacks: samples by process and thread, each function once a sample however
deep it recurses, a command line holding newlines kept in one record, and --within keeping only matching stacks."""
from __future__ import annotations

import re

from tools.spy_table import parse, tables

RAW = [
    'process 10:"python -m bench.gpu_bench";process 11:"python -m worker_svc --port 1";thread (0x1): worker-rpc_0;'
    "Step (worker_svc/server.py:90);launch (worker_svc/model_runner.py:220);fill (worker_svc/staging.py:170) 7\n",
    'process 10:"python -m bench.gpu_bench";process 11:"python -m worker_svc --port 1";thread (0x1): worker-rpc_0;'
    "Step (worker_svc/server.py:90);launch (worker_svc/model_runner.py:224);launch (worker_svc/model_runner.py:230) 3\n",
    'process 10:"python -m bench.gpu_bench";process 12:"python -c import sys\n',
    'print(1)";thread (0x2): MainThread;<module> (<string>:2) 5\n',
    'process 10:"python -m bench.gpu_bench";thread (0x3): MainThread;run (bench/stages/decode.py:150) 4\n',
]


def test_each_record_names_its_innermost_process_and_its_thread():
    records = list(parse(RAW))
    assert [(process, thread, count) for process, thread, _, count in records] == [
        ("worker 11", "worker-rpc_0", 7), ("worker 11", "worker-rpc_0", 3), ("python 12", "MainThread", 5),
        ("bench 10", "MainThread", 4)]
    assert records[0][2] == ["Step (worker_svc/server.py:90)", "launch (worker_svc/model_runner.py:220)",
                             "fill (worker_svc/staging.py:170)"]


def test_a_function_counts_once_a_sample_and_within_keeps_matching_stacks():
    text = tables(RAW, 1000.0, None, 10)
    assert "worker 11: 10 samples (0.010 s)" in text
    assert re.search(r"\s10 100\.0%  launch \(worker_svc/model_runner\.py\)", text), text   # not 13: once a sample
    within = tables(RAW, 1000.0, re.compile("staging"), 10)
    assert "samples within staging: 7 at 1000 Hz" in within
    assert "bench 10" not in within and "python 12" not in within
