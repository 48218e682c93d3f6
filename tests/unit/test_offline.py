"""The in-process engine (no gRPC) gives the same greedy tokens as transformers."""
from __future__ import annotations

import random

from tools.offline import LLM
from common.sampling import SamplingParams
from tests.support.hf_reference import hf_greedy


def test_offline_llm_matches_transformers(tiny_model_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 70))] for _ in range(6)]
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out == hf_greedy(tiny_model_dir, prompt, 12)


def test_the_engine_is_out_of_the_collectors_way_once_built(tiny_model_dir):
    """As the service's processes: once built, the model's objects sit in the permanent generation
    (gc.freeze), so no full collection walks them while generate runs (a pause of the whole batch)."""
    import gc

    try:
        llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_batched_tokens=64)
        walked = {id(o) for o in gc.get_objects()}   # generations 0-2: what a collection walks
        assert gc.get_freeze_count() > 0
        assert id(llm.runner.model) not in walked and id(llm.runner) not in walked
    finally:
        gc.unfreeze()
