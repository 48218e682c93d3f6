"""The parallel layers split across two gloo ranks on the CPU: greedy generation through
ModelRunner on each rank equals transformers' (so sharded loading, the all-reduces and the
LM head's all-gather agree with one unsplit model)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.hf_reference import hf_greedy
from tests.procs import free_port

WORLD_SIZE, NUM_NEW = 2, 6
PROMPTS = {1: [5, 17, 33, 2, 99, 140, 7, 8, 250, 31, 12, 44, 61, 3, 9, 77, 301, 5], 2: [400, 3, 3, 18]}


def _rank_main(rank: int, port: int, model_dir: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        from tests.test_model_runner import Driver, make_runner
        runner = make_runner(model_dir)
        assert (runner.describe().rank, runner.describe().world_size) == (rank, WORLD_SIZE)
        d = Driver(runner)
        d.step(new=[d.new(1, PROMPTS[1], 10), d.new(2, PROMPTS[2], 4)])   # 1: a first chunk
        d.step(cached=[d.cached(1, 8), d.cached(2)])
        for _ in range(NUM_NEW - 1):
            d.step(cached=[d.cached(1), d.cached(2)])
        results.put((rank, {s: d.tokens[s][len(p):][:NUM_NEW] for s, p in PROMPTS.items()}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_generate_like_one_model(tiny_model_dir):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(free_port(), str(tiny_model_dir), queue), nprocs=WORLD_SIZE)
    results = dict(queue.get() for _ in range(WORLD_SIZE))
    expected = {s: hf_greedy(tiny_model_dir, p, NUM_NEW) for s, p in PROMPTS.items()}
    assert results[0] == expected and results[1] == expected
