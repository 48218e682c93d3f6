"""A Qwen3 or Qwen3-MoE checkpoint's config.json as attributes, without importing transformers
(which costs seconds of worker start-up and is not needed to run the model). The file is read
(and its model_type checked) by common.model_dir.read_config_json, as the scheduler reads it.

Keys that every Qwen3 config.json carries are required; the few that older or hand-written
configs omit get transformers' Qwen3Config / Qwen3MoeConfig defaults. A MoE config also names
its experts (`num_experts`, which transformers 5 saves as `num_local_experts`), how many each
token uses and their width; `quantization_config` is kept as written (worker_svc.layers.fp8
reads it).
"""
from __future__ import annotations

import pathlib
from types import SimpleNamespace

from common.model_dir import read_config_json

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings")
_MOE_REQUIRED = ("num_experts_per_tok", "moe_intermediate_size")
_DEFAULTS = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
    "quantization_config": None,
}
_MOE_DEFAULTS = {
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
}


def load_model_config(model_dir: str | pathlib.Path) -> SimpleNamespace:
    raw = read_config_json(model_dir)
    path = pathlib.Path(model_dir) / "config.json"
    moe = raw["model_type"] == "qwen3_moe"
    missing = [key for key in _REQUIRED + (_MOE_REQUIRED if moe else ()) if key not in raw]
    if moe and "num_experts" not in raw and "num_local_experts" not in raw:
        missing.append("num_experts")
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    config = SimpleNamespace(**(_DEFAULTS | (_MOE_DEFAULTS if moe else {}) | raw))
    config.num_key_value_heads = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    config.head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if moe:
        config.num_experts = raw.get("num_experts", raw.get("num_local_experts"))
        config.mlp_only_layers = list(config.mlp_only_layers or [])
        if config.num_experts and not 0 < config.num_experts_per_tok <= config.num_experts:
            raise ValueError(f"{path}: num_experts_per_tok {config.num_experts_per_tok} must be in "
                             f"1..num_experts ({config.num_experts})")
        if config.decoder_sparse_step < 1:
            raise ValueError(f"{path}: decoder_sparse_step must be >= 1, got {config.decoder_sparse_step}")
    # transformers 5 writes "dtype", 4.x wrote "torch_dtype".
    config.dtype = raw.get("dtype") or raw.get("torch_dtype")
    config.raw = raw   # what transformers needs for the scaled-RoPE formulas
    return config
