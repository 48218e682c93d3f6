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
def hf_greedy(model_dir: pathlib.Path, prompt_ids: list[int], num_tokens: int,
              logit_bias: dict[int, float] | None = None) -> list[int]:
    """Greedy continuation of exactly num_tokens tokens, one request at a time so no padding
    enters the reference. EOS is neither masked nor a stop (the service's ignore_eos), so this
    is transformers' model driven by a plain greedy loop over its own KV cache: generate()
    would merge in the checkpoint's EOS ids, and min_new_tokens masks EOS logits. `logit_bias`
    is added to the logits before each argmax (OpenAI's logit_bias)."""
    model = hf_model(model_dir)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    bias = torch.zeros(out.logits.shape[-1])
    for token_id, value in (logit_bias or {}).items():
        bias[token_id] = value
    generated = []
    for _ in range(num_tokens):
        token = int((out.logits[0, -1] + bias).argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def write_dequantized_checkpoint(fp8_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A copy of an FP8 checkpoint (common.tiny_model.write_tiny_qwen3_fp8) with every FP8
    weight multiplied out by its block scales into float32 and no quantization_config: the
    dequantized-weights reference that transformers runs. Plain torch, independent of the
    worker's FP8 code."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(fp8_dir, out, dirs_exist_ok=True)
    config = json.loads((fp8_dir / "config.json").read_text())
    block_rows, block_cols = config.pop("quantization_config")["weight_block_size"]
    tensors = load_file(fp8_dir / "model.safetensors")
    dense = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name + "_scale_inv"].repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
            tensor = tensor.float() * scale[:tensor.shape[0], :tensor.shape[1]]
        dense[name] = tensor
    save_file(dense, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
