"""The worker's Qwen3-MoE against transformers' Qwen3MoeForCausalLM (float32, CPU) on the same
weights: the router, which layers are sparse (mlp_only_layers, decoder_sparse_step), the
reference expert loop, and whole-model logits through the paged path; loading the per-expert
checkpoint layout into stacked tensors, and refusing a checkpoint that lacks an expert."""
from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from common.tiny_model import write_tiny_qwen3_moe
from tests.unit.test_qwen3_model import reference_logits, run_chunks
from tests.support.worker_batches import random_block_tables
from worker_svc import kv_cache
from worker_svc.layers.attention import TorchAttentionBackend
from worker_svc.layers.moe import SparseMoeBlock, route
from worker_svc.loader import init_dummy_weights, load_safetensors
from worker_svc.model_config import load_model_config
from worker_svc.models import build_model

BLOCK_SIZE, NUM_BLOCKS = 8, 64   # as tests/test_qwen3_model.py's run_chunks expects
CONFIGS = {
    # layers 1 and 5 sparse; 3 would be, but mlp_only_layers keeps it dense
    "step2-mlp-only-renorm": dict(num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,), norm_topk_prob=True),
    # every layer sparse, top-3 of 8 without renormalisation, separate LM head
    "all-sparse-no-renorm": dict(num_layers=3, mlp_only_layers=(), num_experts_per_tok=3, norm_topk_prob=False,
                                 tie_word_embeddings=False, seed=1),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe_checkpoint(request, tmp_path_factory) -> pathlib.Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp(request.param) / "model", **CONFIGS[request.param])


def build_worker_model(model_dir: pathlib.Path, quantization: str | None = None, device: str = "cpu"):
    """The model as the worker builds it (models.build_model), loaded, with a KV cache."""
    config = load_model_config(model_dir)
    model = build_model(config, TorchAttentionBackend(), config.max_position_embeddings, quantization,
                        torch.device(device)).eval()
    load_safetensors(model, model_dir)
    kv_cache.allocate_kv_cache(model, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                               torch.float32, torch.device("cpu"))
    return model


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_is_transformers_router(renormalize):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(1)
    router = Qwen3MoeTopKRouter(SimpleNamespace(num_experts_per_tok=3, num_experts=16, norm_topk_prob=renormalize,
                                                hidden_size=32))
    router.weight.data = torch.randn(16, 32, generator=g)
    hidden = torch.randn(25, 32, generator=g)
    _, want_weights, want_ids = router(hidden)
    weights, ids = route(hidden @ router.weight.T, 3, renormalize)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(25)) == renormalize


def test_sparse_layers_are_the_ones_transformers_builds(moe_checkpoint):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    ours = build_worker_model(moe_checkpoint)
    theirs = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in theirs.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == want
    assert any(want)


def test_experts_are_stacked_from_the_per_expert_layout(moe_checkpoint):
    tensors = load_file(moe_checkpoint / "model.safetensors")
    model = build_worker_model(moe_checkpoint)
    layer = next(i for i, l in enumerate(model.model.layers) if isinstance(l.mlp, SparseMoeBlock))
    experts = model.model.layers[layer].mlp.experts
    prefix = f"model.layers.{layer}.mlp"
    for e in range(experts.num_experts):
        gate, up = (tensors[f"{prefix}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up"))
        assert torch.equal(experts.w13_weight[e], torch.cat([gate, up]))
        assert torch.equal(experts.w2_weight[e], tensors[f"{prefix}.experts.{e}.down_proj.weight"])
    assert torch.equal(model.model.layers[layer].mlp.gate.weight, tensors[f"{prefix}.gate.weight"])


def test_reference_loop_is_transformers_experts(moe_checkpoint):
    """The MoE block alone on random hidden states, against transformers' block."""
    model = build_worker_model(moe_checkpoint)
    theirs = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    layer = next(i for i, l in enumerate(model.model.layers) if isinstance(l.mlp, SparseMoeBlock))
    block, reference = model.model.layers[layer].mlp, theirs.model.layers[layer].mlp
    hidden = torch.randn(1, 33, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(block(hidden[0]), reference(hidden)[0], atol=1e-6, rtol=1e-5)


def test_logits_match_transformers_through_the_paged_path(moe_checkpoint):
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 512, (37,), generator=g).tolist()
    expected = reference_logits(moe_checkpoint, prompt)
    model = build_worker_model(moe_checkpoint)
    tables = random_block_tables([38], BLOCK_SIZE, NUM_BLOCKS, g)
    # The prompt in two chunks over the cached prefix, then one decode step.
    for end, length in [(20, 20), (37, 17)]:
        [chunk] = run_chunks(model, tables, [end], [length], [prompt])
        torch.testing.assert_close(chunk, expected[end - length:end], atol=1e-4, rtol=1e-4)
    extended = prompt + [int(expected[-1].argmax())]
    [decode] = run_chunks(model, tables, [38], [1], [extended])
    torch.testing.assert_close(decode[0], reference_logits(moe_checkpoint, extended)[-1], atol=1e-4, rtol=1e-4)


def test_a_missing_expert_fails_loudly(tmp_path, moe_checkpoint):
    tensors = load_file(moe_checkpoint / "model.safetensors")
    layer = next(n.split(".")[2] for n in tensors if ".experts." in n)
    del tensors[f"model.layers.{layer}.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((moe_checkpoint / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"lacks 1 weights.*layers\.{layer}\.mlp\.experts\.w13_weight\[\(5, 'up'\)\]"):
        build_worker_model(tmp_path)


def test_dummy_weights_fill_the_experts(moe_checkpoint):
    config = load_model_config(moe_checkpoint)
    models = [build_model(config, TorchAttentionBackend(), 64, None, torch.device("cpu")) for _ in range(2)]
    for model in models:
        init_dummy_weights(model, seed=3)
    a, b = (torch.cat([p.flatten() for p in m.parameters()]) for m in models)
    assert torch.equal(a, b) and torch.isfinite(a).all()
    sparse = next(l.mlp for l in models[0].model.layers if isinstance(l.mlp, SparseMoeBlock))
    assert sparse.experts.w13_weight.std() > 0.01 and sparse.gate.weight.std() > 0.01
