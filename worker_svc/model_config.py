"""A Qwen3 checkpoint's config.json as attributes, without importing transformers (which
costs seconds of worker start-up and is not needed to run the model).

Keys that every Qwen3 config.json carries are required; the few that older or hand-written
configs omit get transformers' Qwen3Config defaults.
"""
from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings")
_DEFAULTS = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
}


def load_model_config(model_dir: str | pathlib.Path) -> SimpleNamespace:
    path = pathlib.Path(model_dir) / "config.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    if raw.get("model_type") != "qwen3":
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not qwen3")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    config = SimpleNamespace(**(_DEFAULTS | raw))
    config.num_key_value_heads = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    config.head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    # transformers 5 writes "dtype", 4.x wrote "torch_dtype".
    config.dtype = raw.get("dtype") or raw.get("torch_dtype")
    config.raw = raw   # what transformers needs for the scaled-RoPE formulas
    return config
