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
    """Greedy continuation of exactly num_tokens tokens, one request at a time so no padding
    enters the reference. EOS is neither masked nor a stop (the service's ignore_eos), so this
    is transformers' model driven by a plain greedy loop over its own KV cache: generate()
    would merge in the checkpoint's EOS ids, and min_new_tokens masks EOS logits."""
    model = hf_model(model_dir)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    generated = []
    for _ in range(num_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated
