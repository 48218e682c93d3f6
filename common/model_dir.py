"""Facts about a Hugging Face Qwen3 (dense or MoE) model directory, read from its JSON files without loading weights.

The scheduler needs these before (or without) any worker: the vocabulary size to validate token ids,
the context limit, and the EOS ids that end generation. `read_config_json` is the one reader of
config.json: the worker's model config (worker_svc/model_config.py) reads it through it too.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

# Dense Qwen3 and Qwen3-MoE share the tokenizer, the attention and the checkpoint conventions.
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


class ModelDirError(ValueError):
    """The directory is missing, unreadable, or not a Qwen3 checkpoint."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    path: pathlib.Path
    name: str                           # the directory's basename, reported as ModelInfo.model
    vocab_size: int                     # the embedding rows: token ids must be below this
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]      # empty when the checkpoint names none
    architectures: tuple[str, ...]


def read_config_json(model_dir: str | pathlib.Path) -> dict[str, Any]:
    """config.json of `model_dir` as written, once it is known to describe a Qwen3 or Qwen3-MoE model."""
    path = _directory(model_dir)
    config = _read_json(path / "config.json", required=True)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        expected = " or ".join(repr(t) for t in SUPPORTED_MODEL_TYPES)
        raise ModelDirError(
            f"{path / 'config.json'}: model_type is {model_type!r}, expected {expected} (a Qwen3 or Qwen3-MoE checkpoint)"
        )
    return config


def read_model_facts(model_dir: str | pathlib.Path) -> ModelFacts:
    """Reads config.json (and generation_config.json when present) of `model_dir`."""
    path = _directory(model_dir)
    config = read_config_json(path)
    generation_config = _read_json(path / "generation_config.json", required=False)
    # generation_config.json is what transformers' generate() honours, and it often lists more
    # EOS ids than config.json (Qwen3: <|im_end|> and <|endoftext|>), so it wins when it has any.
    eos = generation_config.get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    vocab_size = _positive_int(config, "vocab_size", path)
    return ModelFacts(
        path=path,
        name=path.name,
        vocab_size=vocab_size,
        max_position_embeddings=_positive_int(config, "max_position_embeddings", path),
        eos_token_ids=_eos_token_ids(eos, vocab_size, path),
        architectures=tuple(config.get("architectures") or ()),
    )


def _directory(model_dir: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(model_dir).expanduser().resolve()
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist or is not a directory")
    return path


def _read_json(file: pathlib.Path, *, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise ModelDirError(f"{file} not found: not a Hugging Face model directory")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"{file} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelDirError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _positive_int(config: dict[str, Any], key: str, path: pathlib.Path) -> int:
    value = config.get(key)
    # bool is an int subclass; `true` in a config is a mistake, not the number 1.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelDirError(f"{path / 'config.json'}: {key} must be a positive integer, got {value!r}")
    return value


def _eos_token_ids(value: Any, vocab_size: int, path: pathlib.Path) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise ModelDirError(
            f"{path}: eos_token_id must be a token id below vocab_size {vocab_size} or a list of them, got {value!r}"
        )
    return tuple(dict.fromkeys(ids))  # keeps the order, drops repeats
