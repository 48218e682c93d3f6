"""The worker's wire stays at its edge: the runner and everything it imports load no protobuf,
and what the runner describes reaches the Describe answer field by field."""
from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

from common.features import Feature
from common.pb.llm.worker.v1 import worker_pb2
from worker_svc.runner_io import WorkerInfo
from worker_svc.step_message import build_worker_info

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_runner_and_everything_it_imports_load_no_protobuf():
    script = ("import sys, worker_svc.model_runner\n"
              "print(sorted(m for m in sys.modules\n"
              "             if m.split('.')[0] in ('google', 'grpc') or m.startswith('common.pb')))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_worker_info_reaches_the_describe_answer_field_by_field():
    assert [f.name for f in dataclasses.fields(WorkerInfo)] == [f.name for f in worker_pb2.WorkerInfo.DESCRIPTOR.fields]
    info = WorkerInfo(model="tiny-qwen3", vocab_size=512, max_model_len=4096, block_size=16, num_kv_blocks=64, rank=1,
                      world_size=2, device="cuda:1", attention_backend="triton", dtype="bfloat16",
                      instance_id="4f2a", max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_dtype="float8_e4m3fn",
                      features=(Feature("structured_output", False, "needs 'xgrammar'"),))
    answer = build_worker_info(info)
    assert isinstance(answer, worker_pb2.WorkerInfo)
    fields = {f.name: getattr(answer, f.name) for f in dataclasses.fields(WorkerInfo)}
    fields["features"] = tuple(Feature(f.name, f.available, f.detail) for f in answer.features)
    assert WorkerInfo(**fields) == info
