"""The worker's wire stays at its edge: what the runner describes reaches the Describe answer
field by field (that the runner imports no protobuf, a fresh interpreter checks:
tests/e2e/test_runner_imports.py)."""
from __future__ import annotations

import dataclasses

from common.features import Feature
from common.pb.llm.worker.v1 import worker_pb2
from worker_svc.runner_io import WorkerInfo
from worker_svc.step_message import build_worker_info


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
