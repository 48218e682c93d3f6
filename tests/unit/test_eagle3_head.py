"""The EAGLE-3 head (worker_svc/models/eagle3.py) against a plain-torch forward written from the
published layout, through the paged cache in chunks; its draft vocabulary mapped to target ids
by d2t; its config checked against the target's; and the target's aux hidden states equal to
transformers' hidden states entering those layers."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from common.tiny_model import write_tiny_eagle3, write_tiny_qwen3
from tests.support.worker_batches import paged_metadata, positions_of, random_block_tables
from worker_svc import kv_cache
from worker_svc.layers.attention import TorchAttentionBackend
from worker_svc.loader import load_safetensors
from worker_svc.model_config import load_model_config
from worker_svc.models.eagle3 import Eagle3Head, eagle3_checkpoint, load_eagle3_config, load_eagle3_weights
from worker_svc.models.qwen3 import Qwen3ForCausalLM

BLOCK_SIZE, NUM_BLOCKS = 4, 32
TARGET = SimpleNamespace(num_hidden_layers=2, vocab_size=512, hidden_size=64)
EPS = 1e-6


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_tiny_eagle3(tmp_path_factory.mktemp("eagle3") / "head", seed=3)


def build_head(head_dir, embed: torch.nn.Embedding) -> Eagle3Head:
    config = load_eagle3_config(head_dir, TARGET)
    head = Eagle3Head(config, TorchAttentionBackend(), 256, own_embeddings=False).eval()
    load_eagle3_weights(head, eagle3_checkpoint(head_dir), str(head_dir))
    head.share_embeddings(embed)
    kv_cache.allocate_kv_cache(head, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                               torch.float32, torch.device("cpu"))
    return head


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference(w: dict[str, torch.Tensor], config, embeds: torch.Tensor, aux: torch.Tensor):
    """(normed, pre-norm) hidden states of one whole sequence, from the checkpoint's tensors."""
    n, d = len(embeds), config.head_dim
    hidden = aux @ w["fc.weight"].T
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), rms(hidden, w["midlayer.hidden_norm.weight"])],
                  -1)
    positions = torch.arange(n)
    q = rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, -1, d), positions, config.rope_theta)
    k = rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, -1, d), positions, config.rope_theta)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, -1, d)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    residual = attended @ w["midlayer.self_attn.o_proj.weight"].T + hidden
    y = rms(residual, w["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)
           ) @ w["midlayer.mlp.down_proj.weight"].T
    prenorm = mlp + residual
    return rms(prenorm, w["norm.weight"]), prenorm


@torch.inference_mode()
def test_the_head_equals_a_plain_torch_forward_in_chunks_over_its_cache(head_dir):
    g = torch.Generator().manual_seed(5)
    embed = torch.nn.Embedding(512, 64)
    torch.nn.init.normal_(embed.weight, generator=g)
    head = build_head(head_dir, embed)
    n = 11
    ids = torch.randint(0, 512, (n,), generator=g)
    aux = torch.randn(n, 3 * 64, generator=g)
    expected_normed, expected_prenorm = reference(eagle3_checkpoint(head_dir), head.config, embed(ids), aux)
    tables = random_block_tables([n], BLOCK_SIZE, NUM_BLOCKS, g)
    for end, length in [(6, 6), (10, 4), (11, 1)]:   # a prompt in chunks, then a decode
        meta = paged_metadata(tables, [end], [length], BLOCK_SIZE)
        normed, prenorm = head(ids[end - length:end], positions_of([end], [length]), head.combine(
            [part[end - length:end] for part in aux.split(64, dim=-1)]), meta)
        torch.testing.assert_close(normed, expected_normed[end - length:end], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(prenorm, expected_prenorm[end - length:end], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_draft_ids_map_to_the_target_ids_d2t_names(head_dir):
    head = build_head(head_dir, torch.nn.Embedding(512, 64))
    tensors = eagle3_checkpoint(head_dir)
    kept = torch.nonzero(tensors["t2d"]).flatten()       # the target ids of the draft vocabulary, in order
    assert len(kept) == head.config.draft_vocab_size == 256
    assert torch.equal(torch.arange(256) + tensors["d2t"], kept)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    draft_ids = head.lm_head(hidden).argmax(-1)
    assert torch.equal(head.greedy_tokens(hidden), kept[draft_ids])
    assert (head.greedy_tokens(hidden) < 512).all()


def test_a_head_that_does_not_fit_the_target_is_refused(head_dir, tmp_path):
    config = json.loads((head_dir / "config.json").read_text())
    bad = tmp_path / "bad"
    for key, value, match in [("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
                               "eagle_aux_hidden_state_layer_ids must be 3 layers of the target's 0..1"),
                              ("vocab_size", 1024, "vocab_size 1024 differs from the target's 512"),
                              ("num_hidden_layers", 2, "EAGLE-3 heads have one layer"),
                              ("architectures", ["LlamaForCausalLM"], "is not an EAGLE-3 head")]:
        bad.mkdir(exist_ok=True)
        (bad / "config.json").write_text(json.dumps(config | {key: value}))
        with pytest.raises(ValueError, match=match):
            load_eagle3_config(bad, TARGET)
    # Without the eagle_config the aux layers are vLLM's default for the target's depth.
    (bad / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "eagle_config"}))
    assert load_eagle3_config(bad, SimpleNamespace(num_hidden_layers=36, vocab_size=512, hidden_size=64)
                              ).aux_layers == (2, 18, 33)
    tensors = eagle3_checkpoint(head_dir)
    del tensors["midlayer.self_attn.k_proj.weight"]
    head = Eagle3Head(load_eagle3_config(head_dir, TARGET), TorchAttentionBackend(), 64, own_embeddings=False)
    with pytest.raises(ValueError, match=r"lacks 1 weights, e.g. midlayer.self_attn.qkv_proj.weight\[k\]"):
        load_eagle3_weights(head, tensors, "head")


@torch.inference_mode()
def test_the_targets_aux_hidden_states_are_those_entering_its_layers(tmp_path):
    model_dir = write_tiny_qwen3(tmp_path / "model", num_layers=3)
    config = load_model_config(model_dir)
    model = Qwen3ForCausalLM(config, TorchAttentionBackend()).eval()
    load_safetensors(model, model_dir)
    kv_cache.allocate_kv_cache(model, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                               torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(3)
    meta = paged_metadata(random_block_tables([9], BLOCK_SIZE, NUM_BLOCKS, g), [9], [9], BLOCK_SIZE)
    hidden, aux = model(ids, positions_of([9], [9]), meta, aux_layers=(2, 0, 1))
    assert torch.equal(hidden, model(ids, positions_of([9], [9]), meta))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    states = hf(ids[None], output_hidden_states=True).hidden_states   # states[i]: entering layer i
    for got, layer in zip(aux, (2, 0, 1)):
        torch.testing.assert_close(got, states[layer][0], atol=1e-4, rtol=1e-4)
