"""transformers' Qwen3ForCausalLM on the same checkpoint: the correctness reference."""
from __future__ import annotations

import functools
import pathlib

import torch


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: pathlib.Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model_dir: pathlib.Path, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation of exactly num_tokens tokens (EOS ignored), one request at a time
    so no padding enters the reference."""
    model = hf_model(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
