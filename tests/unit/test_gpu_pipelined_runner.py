"""The worker's overlap on a real GPU: step N+1 is launched before step N's tokens reach the host
(as the gRPC server does), so every decode input is gathered on the device from the step before.
Greedy tokens of the tiny model in float32 (decode through CUDA graphs, and the chunked prefill
through the mixed steps' graphs, and eagerly) equal transformers' on the CPU, and a seeded sampled
request gets the same tokens whether its steps are pipelined or run one at a time; with the torch
sampler and with the device sampler (--sampler kernels), whose decode steps sample inside the graphs
and launch nothing else."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from tests.support.hf_reference import hf_greedy
from worker_svc.config import WorkerConfig
from worker_svc.layers.sampler import SamplingOptions
from worker_svc.model_runner import ModelRunner
from worker_svc.step_message import NewRequest, StepInput
from tests.support.markers import requires_cuda

pytestmark = requires_cuda()

BLOCK = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = {1: list(range(3, 40)), 2: [7, 9, 11, 300, 41], 3: list(range(100, 180))}
NUM_NEW = 12


def step_input(step_id: int, new=(), cached=(), counts=None) -> StepInput:
    cached = list(cached)
    num = np.ones(len(cached), np.int64) if counts is None else np.array(counts, np.int64)
    empty = np.zeros(0, np.int64)
    return StepInput(step_id, [], list(new), cached, num, empty, empty, empty)


def run(runner: ModelRunner, options: SamplingOptions, depth: int) -> dict[int, list[int]]:
    """Prefill (the long prompt in two chunks), then decodes of all three, with up to `depth`
    steps launched whose tokens are not read yet. The schedule needs no token values: the worker
    keeps them on the device."""
    free = iter(range(runner.num_kv_blocks))
    tables = {s: [next(free) for _ in range(-(-(len(p) + NUM_NEW + 1) // BLOCK))] for s, p in PROMPTS.items()}
    new = [NewRequest(s, p, len(p), 0, 50 if s == 3 else len(p), tables[s], options) for s, p in PROMPTS.items()]
    steps = [(step_input(1, new=new), [1, 2]),                                   # 3's first chunk samples nothing
             (step_input(2, cached=[1, 2, 3], counts=[1, 1, len(PROMPTS[3]) - 50]), [1, 2, 3])]
    steps += [(step_input(3 + k, cached=[1, 2, 3]), [1, 2, 3]) for k in range(NUM_NEW - 1)]
    out = {s: [] for s in PROMPTS}
    pending = []
    for step, sampling in steps:
        pending.append((runner.launch(step), sampling))
        if len(pending) == depth:
            done, seqs = pending.pop(0)
            for seq_id, token in zip(seqs, done.result().token_ids, strict=True):
                out[seq_id].append(token)
    for done, seqs in pending:
        for seq_id, token in zip(seqs, done.result().token_ids, strict=True):
            out[seq_id].append(token)
    return {s: v[:NUM_NEW] for s, v in out.items()}


def make_runner(model_dir, sampler: str = "torch", enforce_eager: bool = False) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(model_dir), device=DEVICE, dtype="float32", block_size=BLOCK,
                                    num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256,
                                    max_model_len=256, sampler=sampler, enforce_eager=enforce_eager))


@pytest.mark.parametrize("sampler", ["torch", "kernels"])
def test_pipelined_greedy_decodes_equal_transformers(tiny_model_dir, sampler, monkeypatch):
    from worker_svc import mixed_graphs

    monkeypatch.setattr(mixed_graphs, "ENABLED", True)
    runner = make_runner(tiny_model_dir, sampler)
    assert runner.decode_graphs is not None
    assert runner.decode_graphs.staged == (sampler == "kernels")
    got = run(runner, SamplingOptions(temperature=0.0), depth=2)
    assert runner.mixed_graphs is not None and runner.mixed_graphs.replays == 2, "both prompt steps replay"
    for seq_id, prompt in PROMPTS.items():
        assert got[seq_id] == hf_greedy(tiny_model_dir, prompt, NUM_NEW), f"sequence {seq_id}"
    eager_prompts = make_runner(tiny_model_dir, sampler)
    eager_prompts.mixed_graphs = None
    assert run(eager_prompts, SamplingOptions(temperature=0.0), depth=2) == got


@pytest.mark.parametrize("sampler", ["torch", "kernels"])
def test_seeded_sampling_is_the_same_pipelined_or_not(tiny_model_dir, sampler):
    options = SamplingOptions(temperature=0.9, top_k=50, seed=7, repetition_penalty=1.2)
    ahead = run(make_runner(tiny_model_dir, sampler), options, depth=3)
    one_by_one = run(make_runner(tiny_model_dir, sampler), options, depth=1)
    assert ahead == one_by_one


def test_the_kernels_draw_the_same_tokens_inside_the_graphs_as_eagerly(tiny_model_dir):
    options = SamplingOptions(temperature=0.8, top_p=0.9, min_p=0.02, seed=11, presence_penalty=0.5)
    assert run(make_runner(tiny_model_dir, "kernels"), options, depth=2) == \
        run(make_runner(tiny_model_dir, "kernels", enforce_eager=True), options, depth=2)


def test_a_graph_decode_step_launches_two_replays_and_two_copies(tiny_model_dir):
    from torch.profiler import ProfilerActivity, profile

    runner = make_runner(tiny_model_dir, "kernels")
    options = SamplingOptions(temperature=0.7, top_k=20, top_p=0.9, seed=3)
    new = [NewRequest(s, p, len(p), 0, len(p), [3 * s, 3 * s + 1, 3 * s + 2], options)
           for s, p in PROMPTS.items() if len(p) < 40]
    runner.step(step_input(1, new=new))
    runner.step(step_input(2, cached=[n.seq_id for n in new]))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.step(step_input(3, cached=[n.seq_id for n in new]))
    calls = collections.Counter(e.name for e in prof.events() if e.name.startswith(("cuda", "cu")))

    def count(part: str) -> int:
        return sum(n for name, n in calls.items() if part in name)

    # The two replays (forward, sampling), no kernel launched alone, the staged inputs in and the tokens out.
    assert (count("GraphLaunch"), count("LaunchKernel"), count("Memcpy")) == (2, 0, 2), calls
