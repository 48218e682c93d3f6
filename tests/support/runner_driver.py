"""A ModelRunner driven step by step as the scheduler would drive it: Driver hands out blocks,
tracks every sequence and builds the StepRequests (tests/unit/test_model_runner.py, the grammar
and tensor-parallel runs under tests/e2e)."""
from __future__ import annotations

import pytest
import torch

from common.pb.llm.worker.v1 import worker_pb2 as pb
from tests.support.triton_interpreter import INTERPRETED
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import ModelRunner
from worker_svc.step_message import parse_step_request

BLOCK_SIZE = 16
GREEDY = pb.SamplingOptions(temperature=0.0)
# The torch sampler, or the device sampler's kernels (interpreted on the CPU).
SAMPLERS = ("torch", pytest.param("kernels", marks=pytest.mark.skipif(
    not INTERPRETED, reason="the runner here is on the CPU: its kernels need Triton's interpreter")))


def skip_long_interpreted(sampler: str) -> None:
    """Tens of interpreted sampling steps take minutes on the CPU: the kernels' seeded and masked
    draws are checked one step at a time in test_sampling_kernels.py, and through the runner's
    graphs on a GPU (test_gpu_pipelined_runner.py)."""
    if sampler == "kernels" and INTERPRETED:
        pytest.skip("long runs of interpreted sampling kernels (covered per step in test_sampling_kernels.py)")


def grow_blocks(blocks: list[int], free_blocks: list[int], num_tokens: int) -> list[int]:
    """Appends to a sequence's `blocks` what it needs to hold num_tokens; returns the new ones."""
    needed = -(-num_tokens // BLOCK_SIZE) - len(blocks)
    fresh = [free_blocks.pop() for _ in range(max(needed, 0))]
    blocks += fresh
    return fresh


class Driver:
    """A scheduler in miniature: hands out blocks, tracks every sequence, builds the messages."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free_blocks = list(range(runner.num_kv_blocks))[::-1]   # pop() hands out 0, 1, ...
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.step_id = 0
        self.outputs = []

    def _grow(self, seq_id: int, num_tokens: int) -> list[int]:
        return grow_blocks(self.blocks[seq_id], self.free_blocks, num_tokens)

    def new(self, seq_id: int, token_ids: list[int], num_scheduled: int, sampling=GREEDY, *,
            num_prompt: int | None = None, cached_prefix_blocks: list[int] = (),
            constraint: pb.Constraint | None = None) -> pb.NewRequest:
        self.tokens[seq_id] = list(token_ids)
        self.blocks[seq_id] = list(cached_prefix_blocks)
        self.computed[seq_id] = len(cached_prefix_blocks) * BLOCK_SIZE
        self._grow(seq_id, self.computed[seq_id] + num_scheduled)
        msg = pb.NewRequest(seq_id=seq_id, token_ids=token_ids, num_prompt_tokens=num_prompt or len(token_ids),
                            num_computed_tokens=self.computed[seq_id], num_scheduled_tokens=num_scheduled,
                            block_ids=self.blocks[seq_id], sampling=sampling)
        if constraint is not None:
            msg.sampling.constraint.CopyFrom(constraint)
        return msg

    def cached(self, seq_id: int, num_scheduled: int = 1) -> tuple[int, int, list[int]]:
        return seq_id, num_scheduled, self._grow(seq_id, self.computed[seq_id] + num_scheduled)

    def step(self, new=(), cached=(), finished=()) -> dict[int, int]:
        self.step_id += 1
        output = self.runner.step(parse_step_request(step_request(self.step_id, new, cached, finished)))
        assert output.step_id == self.step_id
        self.outputs.append(output)
        order = [seq_id for seq_id, _, _ in cached] + [r.seq_id for r in new]
        counts = [n for _, n, _ in cached] + [r.num_scheduled_tokens for r in new]
        sampling = []
        for seq_id, n in zip(order, counts):
            self.computed[seq_id] += n
            if self.computed[seq_id] == len(self.tokens[seq_id]):
                sampling.append(seq_id)
        assert len(output.token_ids) == len(sampling)
        self.logprobs = dict(zip(sampling, output.logprobs or []))
        sampled = dict(zip(sampling, output.token_ids))
        for seq_id, token in sampled.items():
            self.tokens[seq_id].append(token)
        return sampled

    def forget(self, seq_id: int) -> None:
        self.free_blocks += self.blocks.pop(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]


def step_request(step_id: int, new=(), cached=(), finished=()) -> pb.StepRequest:
    """A StepRequest with cached requests given as (seq_id, num_scheduled, new_block_ids)."""
    columns = pb.CachedRequests(seq_ids=[seq_id for seq_id, _, _ in cached])
    for i, (_, n, blocks) in enumerate(cached):
        if n != 1:
            columns.multi_token_indices.append(i)
            columns.multi_token_counts.append(n)
        add_new_blocks(columns, i, blocks)
    return pb.StepRequest(step_id=step_id, new_requests=new, cached=columns, finished_seq_ids=finished)


def add_new_blocks(columns: pb.CachedRequests, index: int, blocks: list[int]) -> None:
    """Lists the blocks the cached request at `index` grew by this step, if any."""
    if blocks:
        columns.new_block_indices.append(index)
        columns.new_block_counts.append(len(blocks))
        columns.new_block_ids.extend(blocks)


def make_runner(model_dir, **overrides) -> ModelRunner:
    settings = {"num_kv_blocks": 64, "block_size": BLOCK_SIZE} | overrides
    return ModelRunner(WorkerConfig(model=str(model_dir), **settings))


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
