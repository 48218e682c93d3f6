"""The worker's Qwen3 against transformers' Qwen3ForCausalLM (float32, CPU) on the same weights,
through the paged path: whole prompts, chunks over a cached prefix, and mixed batches.
Also the loader: sharded checkpoints, and checkpoints that lack weights."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from common.tiny_model import write_tiny_qwen3
from tests.support.worker_batches import paged_metadata, positions_of, random_block_tables
from worker_svc import kv_cache
from worker_svc.layers.attention import TorchAttentionBackend
from worker_svc.loader import init_dummy_weights, load_safetensors
from worker_svc.model_config import load_model_config
from worker_svc.models.qwen3 import Qwen3ForCausalLM

BLOCK_SIZE, NUM_BLOCKS = 8, 64
CONFIGS = {
    "tied-gqa2": {},                                            # 4:2 GQA, head_dim 32 != 64/4
    "untied": {"tie_word_embeddings": False, "seed": 1},
    "gqa4-plain-head-dim": {"num_kv_heads": 1, "head_dim": 16, "seed": 2},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp(request.param) / "model", **CONFIGS[request.param])


def build_model(model_dir) -> Qwen3ForCausalLM:
    config = load_model_config(model_dir)
    model = Qwen3ForCausalLM(config, TorchAttentionBackend()).eval()
    load_safetensors(model, model_dir)
    kv_cache.allocate_kv_cache(model, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                               torch.float32, torch.device("cpu"))
    return model


@torch.inference_mode()
def reference_logits(model_dir, token_ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf(torch.tensor([token_ids])).logits[0]


@torch.inference_mode()
def run_chunks(model, tables, seq_lens, query_lens, token_lists) -> list[torch.Tensor]:
    """One forward over the batch; returns each request's logits for its computed tokens."""
    meta = paged_metadata(tables, seq_lens, query_lens, BLOCK_SIZE)
    input_ids = torch.tensor([t for ids, s, q in zip(token_lists, seq_lens, query_lens) for t in ids[s - q:s]])
    hidden = model(input_ids, positions_of(seq_lens, query_lens), meta)
    logits = model.compute_logits(hidden, torch.arange(len(input_ids)))
    return list(logits.split(query_lens))


def test_plain_prompt_and_chunks_over_a_cached_prefix(checkpoint):
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 512, (45,), generator=g).tolist()
    expected = reference_logits(checkpoint, prompt)
    model = build_model(checkpoint)

    [whole] = run_chunks(model, random_block_tables([45], BLOCK_SIZE, NUM_BLOCKS, g), [45], [45], [prompt])
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)

    # The same prompt again in three chunks (13, 20, 12 tokens), each attending the KV the
    # earlier chunks left in the cache, then one decode step.
    tables = random_block_tables([46], BLOCK_SIZE, NUM_BLOCKS, g)
    for end, length in [(13, 13), (33, 20), (45, 12)]:
        [chunk] = run_chunks(model, tables, [end], [length], [prompt])
        torch.testing.assert_close(chunk, expected[end - length:end], atol=1e-4, rtol=1e-4)
    extended = prompt + [int(expected[-1].argmax())]
    [decode] = run_chunks(model, tables, [46], [1], [extended])
    torch.testing.assert_close(decode[0], reference_logits(checkpoint, extended)[-1], atol=1e-4, rtol=1e-4)


def test_batch_mixing_decodes_and_prefill_chunks(checkpoint):
    g = torch.Generator().manual_seed(11)
    lengths = [30, 17, 40, 9]
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    expected = [reference_logits(checkpoint, p) for p in prompts]
    model = build_model(checkpoint)
    tables = random_block_tables(lengths, BLOCK_SIZE, NUM_BLOCKS, g)
    # Step 1 fills caches: request 0 up to its last token, 1 up to its last, 2 a first chunk of
    # 25; request 3 is not scheduled yet.
    run_chunks(model, tables[:3], [29, 16, 25], [29, 16, 25], prompts[:3])
    # Step 2: two decodes, a chunk over request 2's cached 25 tokens, and a whole new prompt.
    outs = run_chunks(model, tables, [30, 17, 40, 9], [1, 1, 15, 9], prompts)
    for out, exp, query_len in zip(outs, expected, [1, 1, 15, 9]):
        torch.testing.assert_close(out, exp[-query_len:], atol=1e-4, rtol=1e-4)


def rewrite_config(src, dst, edit) -> None:
    """dst gets src's weights and an edited copy of its config.json."""
    config = json.loads((src / "config.json").read_text())
    edit(config)
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())


def old_style_rope(config: dict) -> None:
    """transformers 4 wrote rope_theta at the top level (and rope_scaling beside it)."""
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["rope_scaling"] = None


def yarn_rope(config: dict) -> None:
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("edit", [old_style_rope, yarn_rope])
def test_rope_configurations(edit, tmp_path, tiny_model_dir):
    rewrite_config(tiny_model_dir, tmp_path, edit)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    tables = random_block_tables([40], BLOCK_SIZE, NUM_BLOCKS, torch.Generator().manual_seed(4))
    [logits] = run_chunks(build_model(tmp_path), tables, [40], [40], [prompt])
    torch.testing.assert_close(logits, reference_logits(tmp_path, prompt), atol=1e-4, rtol=1e-4)


def test_loads_sharded_checkpoints(tmp_path, tiny_model_dir):
    """A checkpoint split over two files with an index, as large models ship, loads the same."""
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, tmp_path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    sharded, single = build_model(tmp_path), build_model(tiny_model_dir)
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters()):
        assert torch.equal(a, b), name


def test_missing_weights_fail_loudly(tmp_path, tiny_model_dir):
    tensors = load_file(tiny_model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"lacks 1 weights.*qkv_proj.weight\[k\]"):
        build_model(tmp_path)


def test_dummy_weights_are_seeded_and_finite(tiny_model_dir):
    config = load_model_config(tiny_model_dir)
    models = [Qwen3ForCausalLM(config, TorchAttentionBackend()) for _ in range(3)]
    for model, seed in zip(models, [5, 5, 6]):
        init_dummy_weights(model, seed)
    params = [torch.cat([p.flatten() for p in m.parameters()]) for m in models]
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], params[2])
    assert torch.isfinite(params[0]).all()
    assert torch.equal(models[0].model.norm.weight, torch.ones(config.hidden_size))
