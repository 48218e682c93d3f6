"""The benchmark workload: nano-vllm's bench.py.

256 requests, prompt and output lengths uniform in 100..1024, prompt ids uniform in 0..10000,
ignore_eos; drawn with Python's `random` seeded 0 in nano-vllm's order, so the requests are
exactly nano-vllm's. Its floor is bench/floor.py's workload_floor.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]


def nano_vllm_workload(num_requests: int = 256, min_len: int = 100, max_input_len: int = 1024,
                       max_output_len: int = 1024, seed: int = 0, max_token_id: int = 10000) -> Workload:
    """max_token_id: nano-vllm's 10000; lower only for models with a smaller vocabulary."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(min_len, max_input_len))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(min_len, max_output_len) for _ in range(num_requests)]
    return Workload(prompts, max_tokens)
