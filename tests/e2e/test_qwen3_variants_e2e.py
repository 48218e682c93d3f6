"""The Qwen3 family beyond the dense tiny model, through the whole service (separate scheduler
and worker processes, gRPC, CPU float32): greedy tokens equal transformers' for
- a Qwen3-MoE whose dense and sparse layers are mixed by decoder_sparse_step and
  mlp_only_layers, without top-k renormalisation, in chunked prefill mixed with decodes;
- the same kind of model with renormalisation, on a tensor-parallel group of two (gloo);
- a block-FP8 checkpoint, against transformers on its dequantized weights, whose logits the
  service's logprobs match to 1e-4 (on the CPU the worker dequantizes at load);
- the LM head quantized to FP8 at load (--lm-head-dtype fp8), against its quantized values;
- YaRN, with prompts longer than original_max_position_embeddings, in both config spellings.
One process set per test, a few short prompts each."""
from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch

from common.tiny_model import write_tiny_qwen3, write_tiny_qwen3_fp8, write_tiny_qwen3_moe
from tests.support.client import generate_many
from tests.support.hf_reference import hf_greedy, hf_model, write_dequantized_checkpoint
from tests.support.procs import running_services

pytestmark = pytest.mark.timeout(240)
# A 48-token step budget: the longer prompts are computed in chunks, mixed with decodes.
CHUNKED = ("--max-num-batched-tokens", "48")


def requests(seed: int, lengths: list[int], vocab_size: int = 512, logprobs: bool = False) -> list[dict]:
    rng = random.Random(seed)
    return [dict(token_ids=[rng.randrange(3, vocab_size) for _ in range(n)], temperature=0.0, ignore_eos=True,
                 max_tokens=rng.randint(4, 10), logprobs=logprobs) for n in lengths]


def serve(model_dir: pathlib.Path, log_dir: pathlib.Path, reqs: list[dict], **launch) -> list:
    with running_services(model_dir, log_dir, **launch) as svc, svc.channel() as channel:
        return generate_many(channel, reqs)


def assert_greedy_like_transformers(model_dir: pathlib.Path, reqs: list[dict], completions: list) -> None:
    for i, (req, got) in enumerate(zip(reqs, completions)):
        want = hf_greedy(model_dir, req["token_ids"], req["max_tokens"])
        assert got.token_ids == want, f"request {i} ({len(req['token_ids'])} prompt tokens) diverged from transformers"


def assert_logprobs_like_transformers(model_dir: pathlib.Path, reqs: list[dict], completions: list) -> None:
    """Each returned token's logprob is transformers' (float32 logits on model_dir) to 1e-4."""
    model = hf_model(model_dir)
    for req, got in zip(reqs, completions):
        with torch.inference_mode():
            logits = model(torch.tensor([req["token_ids"] + got.token_ids[:-1]])).logits[0].float()
        positions = range(len(req["token_ids"]) - 1, len(req["token_ids"]) - 1 + len(got.token_ids))
        want = [torch.log_softmax(logits[p], -1)[t].item() for p, t in zip(positions, got.token_ids)]
        assert got.logprobs == pytest.approx(want, abs=1e-4)


def test_moe_with_mixed_layers_matches_transformers(tmp_path):
    # Layers 1 and 5 are sparse; 3 would be, but mlp_only_layers keeps it dense. Top-2 of 8,
    # weights not renormalised.
    model_dir = write_tiny_qwen3_moe(tmp_path / "moe", num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,),
                                     norm_topk_prob=False, seed=3)
    reqs = requests(11, [7, 30, 19, 3, 90])
    completions = serve(model_dir, tmp_path / "logs", reqs, scheduler_args=CHUNKED)
    assert_greedy_like_transformers(model_dir, reqs, completions)


def test_moe_on_two_tensor_parallel_ranks_matches_transformers(tmp_path):
    """Each rank holds half of every expert's intermediate dimension; top-k renormalised."""
    model_dir = write_tiny_qwen3_moe(tmp_path / "moe", norm_topk_prob=True, seed=4)
    reqs = requests(12, [12, 40, 5, 70])
    completions = serve(model_dir, tmp_path / "logs", reqs, num_workers=2, tensor_parallel_size=2,
                        scheduler_args=CHUNKED)
    assert_greedy_like_transformers(model_dir, reqs, completions)


def test_fp8_checkpoint_matches_its_dequantized_weights(tmp_path):
    fp8_dir = write_tiny_qwen3_fp8(tmp_path / "fp8", moe=True, seed=5)
    dequantized = write_dequantized_checkpoint(fp8_dir, tmp_path / "dequantized")
    reqs = requests(13, [9, 33, 60], logprobs=True)
    completions = serve(fp8_dir, tmp_path / "logs", reqs)
    assert_greedy_like_transformers(dequantized, reqs, completions)
    assert_logprobs_like_transformers(dequantized, reqs, completions)


@pytest.mark.parametrize("checkpoint,ranks", [("bf16", 1), ("bf16", 2), ("fp8", 1)])
def test_an_fp8_lm_head_computes_from_its_quantized_weight(tmp_path, checkpoint, ranks):
    """--lm-head-dtype fp8 on the tiny model, whose LM head is tied to the embedding: greedy tokens and
    logprobs are transformers' on a checkpoint whose head is the block-quantized embedding (quantized by the
    format's plain reference), untied from the embedding, which stays as it was. A bf16 checkpoint's head in
    128 x 128 blocks, on one rank and on a tensor-parallel group of two (each quantizes its 256 vocabulary
    rows: the same blocks); an FP8 checkpoint's in its own blocks (32 x 32), against its dequantized weights."""
    from safetensors.torch import load_file, save_file

    from common.tiny_model import quantize_fp8_blocks

    if checkpoint == "fp8":
        model_dir = write_tiny_qwen3_fp8(tmp_path / "fp8", seed=6)
        reference = write_dequantized_checkpoint(model_dir, tmp_path / "reference")
        block = (32, 32)
    else:
        model_dir = write_tiny_qwen3(tmp_path / "tiny", seed=6)
        reference = tmp_path / "reference"
        reference.mkdir()
        for path in model_dir.iterdir():
            if path.is_file():
                (reference / path.name).write_bytes(path.read_bytes())
        block = (128, 128)
    config = json.loads((reference / "config.json").read_text())
    assert config["tie_word_embeddings"]
    tensors = load_file(reference / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    values, scale = quantize_fp8_blocks(embedding, block)
    scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:embedding.shape[0], :embedding.shape[1]]
    tensors["lm_head.weight"] = (values.float() * scale).to(embedding.dtype)
    assert not torch.equal(tensors["lm_head.weight"], embedding)
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    (reference / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    reqs = requests(14, [8, 41, 23], logprobs=True)
    completions = serve(model_dir, tmp_path / "logs", reqs, worker_args=("--lm-head-dtype", "fp8"),
                        num_workers=ranks, tensor_parallel_size=ranks)
    assert_greedy_like_transformers(reference, reqs, completions)
    assert_logprobs_like_transformers(reference, reqs, completions)


def yarn_in_rope_parameters(config: dict) -> None:
    """transformers 5's spelling."""
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64}


def yarn_in_rope_scaling(config: dict) -> None:
    """The older spelling Qwen3's model cards suggest: rope_theta beside rope_scaling."""
    config.pop("rope_parameters", None)
    config["rope_theta"] = 1_000_000.0
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("spelling", [yarn_in_rope_parameters, yarn_in_rope_scaling])
def test_yarn_past_the_original_context_matches_transformers(tmp_path, spelling):
    model_dir = write_tiny_qwen3(tmp_path / "yarn", max_position_embeddings=256, seed=6)
    config = json.loads((model_dir / "config.json").read_text())
    spelling(config)
    (model_dir / "config.json").write_text(json.dumps(config))
    reqs = requests(14, [150, 90, 20])   # 64 original positions; two prompts reach well past them
    completions = serve(model_dir, tmp_path / "logs", reqs)
    assert_greedy_like_transformers(model_dir, reqs, completions)
