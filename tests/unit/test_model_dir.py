"""common.model_dir: facts of a checkpoint directory from its JSON files, and clear refusals."""
from __future__ import annotations

import json

import pytest

from common.model_dir import ModelDirError, read_model_facts

QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "eos_token_id": 151645,
}


def write_dir(root, config=QWEN3_CONFIG, generation_config=None, name="Qwen3-0.6B"):
    path = root / name
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_tiny_checkpoint_facts(tiny_model_dir):
    facts = read_model_facts(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert facts.name == tiny_model_dir.name == "tiny-qwen3"
    assert facts.path == tiny_model_dir.resolve()
    assert facts.vocab_size == config["vocab_size"]
    assert facts.max_position_embeddings == config["max_position_embeddings"]
    # generation_config.json lists both <|im_end|> and <|endoftext|>; config.json only the first.
    assert facts.eos_token_ids == tuple(json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"])
    assert facts.eos_token_ids[0] == config["eos_token_id"]
    assert facts.architectures == ("Qwen3ForCausalLM",)


def test_generation_config_eos_list_wins_and_repeats_drop(tmp_path):
    path = write_dir(tmp_path, generation_config={"eos_token_id": [151645, 151643, 151645]})
    assert read_model_facts(str(path)).eos_token_ids == (151645, 151643)


@pytest.mark.parametrize("generation_config", [None, {"do_sample": True}, {"eos_token_id": None}])
def test_eos_falls_back_to_config_json(tmp_path, generation_config):
    path = write_dir(tmp_path, generation_config=generation_config)
    assert read_model_facts(path).eos_token_ids == (151645,)


def test_no_eos_anywhere_means_none(tmp_path):
    config = {k: v for k, v in QWEN3_CONFIG.items() if k != "eos_token_id"}
    assert read_model_facts(write_dir(tmp_path, config)).eos_token_ids == ()


def test_missing_directory(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist or is not a directory"):
        read_model_facts(tmp_path / "nope")


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelDirError, match=r"config\.json not found: not a Hugging Face model directory"):
        read_model_facts(write_dir(tmp_path, config=None))


@pytest.mark.parametrize("text, fragment", [("{not json", "is not readable JSON"), ("[1, 2]", "must hold a JSON object, got list")])
def test_malformed_config_json(tmp_path, text, fragment):
    with pytest.raises(ModelDirError, match=fragment):
        read_model_facts(write_dir(tmp_path, config=text))


def test_not_a_qwen3_checkpoint(tmp_path):
    path = write_dir(tmp_path, {**QWEN3_CONFIG, "model_type": "llama"})
    with pytest.raises(ModelDirError, match="model_type is 'llama', expected 'qwen3'"):
        read_model_facts(path)


def test_the_worker_reads_config_json_through_the_same_reader(tmp_path, tiny_model_dir):
    """worker_svc.model_config refuses what read_model_facts refuses, in the same words, and
    reads the same file."""
    from worker_svc.model_config import load_model_config

    with pytest.raises(ModelDirError, match="model_type is 'llama', expected 'qwen3'"):
        load_model_config(write_dir(tmp_path, {**QWEN3_CONFIG, "model_type": "llama"}))
    with pytest.raises(ModelDirError, match=r"config\.json not found"):
        load_model_config(write_dir(tmp_path, config=None, name="empty"))
    config, facts = load_model_config(tiny_model_dir), read_model_facts(tiny_model_dir)
    assert (config.vocab_size, config.max_position_embeddings) == (facts.vocab_size, facts.max_position_embeddings)


@pytest.mark.parametrize("key, value", [("vocab_size", None), ("vocab_size", 0), ("max_position_embeddings", "4096"), ("max_position_embeddings", True)])
def test_bad_sizes(tmp_path, key, value):
    config = {**QWEN3_CONFIG, key: value}
    if value is None:
        del config[key]
    with pytest.raises(ModelDirError, match=f"{key} must be a positive integer, got {value!r}"):
        read_model_facts(write_dir(tmp_path, config))


@pytest.mark.parametrize("eos", [151936, [1, "2"], -1])
def test_bad_eos_ids(tmp_path, eos):
    path = write_dir(tmp_path, generation_config={"eos_token_id": eos})
    with pytest.raises(ModelDirError, match="eos_token_id must be a token id below vocab_size 151936"):
        read_model_facts(path)
