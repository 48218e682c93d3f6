"""Where the FP8 KV cache's scales come from (worker_svc/kv_cache_scales.py), and what an FP8
cache does to the worker: the weights' bound is never exceeded by any K or V the model computes
and is reached by some input (so it is the least scale that never saturates); a checkpoint's
k_scale/v_scale in each of vLLM's layouts wins over it, and the weight loader passes over them;
an FP8 cache holds twice the blocks of a bfloat16 one in the same memory, the worker reports its
type, and the tiny model's logits over an FP8 cache stay close to those over a float32 one."""
from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.worker_batches import paged_metadata, positions_of, random_block_tables
from worker_svc import kv_cache
from worker_svc.config import WorkerConfig, add_worker_arguments, worker_config_from_args
from worker_svc.kv_cache_scales import BOUND_MARGIN, bind_kv_scales, is_attention_scale
from worker_svc.layers.attention import TorchAttentionBackend
from worker_svc.layers.attention.kv_quant import FP8_KV_DTYPE, FP8_KV_MAX, resolve_kv_cache_dtype
from worker_svc.layers.rotary import norm_and_rotate_qkv
from worker_svc.loader import load_safetensors, safetensors_files
from worker_svc.model_config import load_model_config
from worker_svc.model_runner import ModelRunner
from worker_svc.models.qwen3 import Qwen3ForCausalLM


def tiny_model(model_dir) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(load_model_config(model_dir), TorchAttentionBackend()).eval()
    load_safetensors(model, model_dir)
    return model


@torch.inference_mode()
def layer_kv(layer, hidden: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K (normed, rotated) and V a decoder layer computes from residual-stream rows."""
    attn = layer.self_attn
    qkv = attn.qkv_proj(layer.input_layernorm(hidden))
    _, k, v = norm_and_rotate_qkv(qkv, attn.q_norm, attn.k_norm, cos_sin, attn.num_heads, attn.num_kv_heads)
    return k, v


def adversarial_hidden(layer, generator: torch.Generator, hidden_size: int, head_dim: int) -> torch.Tensor:
    """Residual rows meant to reach the bound: random ones, ones with a huge outlier channel, and
    for each value row j the direction of W_v[j] * g (where |v_j| is largest)."""
    random_rows = torch.randn(64, hidden_size, generator=generator) * torch.logspace(-3, 3, 64)[:, None]
    outliers = torch.randn(16, hidden_size, generator=generator)
    outliers[torch.arange(16), torch.randint(0, hidden_size, (16,), generator=generator)] = 1e4
    attn = layer.self_attn
    v_start = (attn.num_heads + attn.num_kv_heads) * head_dim
    w_v = attn.qkv_proj.weight[v_start:v_start + attn.num_kv_heads * head_dim]
    aligned = w_v * layer.input_layernorm.weight   # RMSNorm scales each aligned row to |x̂| = sqrt(hidden)
    return torch.cat([random_rows, outliers, aligned, -aligned])


def test_the_weight_bound_is_never_exceeded_and_is_reached(tiny_model_dir):
    model = tiny_model(tiny_model_dir)
    bind_kv_scales(model, FP8_KV_DTYPE, [])
    g = torch.Generator().manual_seed(3)
    config = model.config
    for layer in model.model.layers:
        hidden = adversarial_hidden(layer, g, config.hidden_size, config.head_dim)
        positions = torch.randint(0, 4096, (hidden.shape[0],), generator=g)
        positions[-2 * config.num_key_value_heads * config.head_dim:] = 0   # unrotated: |k| meets its bound
        k, v = layer_kv(layer, hidden, model.model.rotary_emb(positions))
        scales = layer.self_attn.attn.kv_scales
        for values, scale in ((k, scales.k), (v, scales.v)):
            largest = values.abs().amax(dim=(0, 2))          # per kv head
            limit = scale * FP8_KV_MAX
            assert (largest <= limit).all(), (largest, limit)
        # The aligned rows reach V's bound (less the margin) in every head.
        v_largest = v.abs().amax(dim=(0, 2))
        assert torch.allclose(v_largest * BOUND_MARGIN, scales.v * FP8_KV_MAX, rtol=1e-3)


def test_an_unquantized_cache_has_no_scales(tiny_model_dir):
    model = tiny_model(tiny_model_dir)
    bind_kv_scales(model, torch.bfloat16, [])
    assert all(layer.kv_scales is None for layer in model.attention_layers())


def write_checkpoint_with_scales(source, target, scales: dict[str, torch.Tensor]):
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors") | scales
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_checkpoint_scales_in_vllm_layouts_win_over_the_bound(tiny_model_dir, tmp_path):
    kv_heads = 2
    per_head = torch.tensor([0.02, 0.04])
    model_dir = write_checkpoint_with_scales(tiny_model_dir, tmp_path / "scaled", {
        # ModelOpt: on the projections; a scalar per tensor.
        "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.25]),
        # compressed-tensors / vLLM's own: on the attention, here one per kv head; q_scale is unused.
        "model.layers.1.self_attn.attn.k_scale": per_head,
        "model.layers.1.self_attn.v_scale": per_head * 2,
        "model.layers.1.self_attn.q_scale": torch.tensor(1.0),
    })
    model = tiny_model(model_dir)   # the loader passes over the scales
    bound = tiny_model(tiny_model_dir)
    bind_kv_scales(bound, FP8_KV_DTYPE, [])
    bind_kv_scales(model, FP8_KV_DTYPE, safetensors_files(model_dir))
    first, second = (layer.kv_scales for layer in model.attention_layers())
    assert first.k.tolist() == [0.5] * kv_heads and first.v.tolist() == [0.25] * kv_heads
    assert torch.equal(second.k, per_head) and torch.equal(second.v, per_head * 2)
    assert torch.equal(first.k_inv, 1 / first.k)

    older = write_checkpoint_with_scales(tiny_model_dir, tmp_path / "older", {
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.125)})   # deprecated: both K and V
    model = tiny_model(older)
    bind_kv_scales(model, FP8_KV_DTYPE, safetensors_files(older))
    first, second = (layer.kv_scales for layer in model.attention_layers())
    assert second.k.tolist() == second.v.tolist() == [0.125] * kv_heads
    assert torch.equal(first.v, bound.attention_layers()[0].kv_scales.v)   # no scale given: the bound


def test_a_scale_of_the_wrong_size_is_refused_by_name(tiny_model_dir, tmp_path):
    model_dir = write_checkpoint_with_scales(tiny_model_dir, tmp_path / "bad", {
        "model.layers.0.self_attn.k_scale": torch.ones(3)})
    with pytest.raises(ValueError, match="layer 0's k_scale has 3 values"):
        bind_kv_scales(tiny_model(model_dir), FP8_KV_DTYPE, safetensors_files(model_dir))


def test_only_attention_scales_are_passed_over_by_the_loader():
    assert is_attention_scale("model.layers.12.self_attn.k_proj.k_scale")
    assert is_attention_scale("model.layers.0.self_attn.attn.prob_scale")
    assert not is_attention_scale("model.layers.0.self_attn.k_proj.weight_scale_inv")
    assert not is_attention_scale("model.layers.0.self_attn.k_proj.input_scale")
    assert not is_attention_scale("model.layers.0.mlp.k_scale")


def test_kv_cache_dtype_names():
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"])
    assert worker_config_from_args(args).kv_cache_dtype == "fp8"
    assert worker_config_from_args(parser.parse_args(["--model", "m"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "int4"])
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int4", torch.float32)


def test_an_fp8_cache_holds_twice_the_blocks_and_the_worker_says_so(tiny_model_dir):
    assert kv_cache.block_bytes(28, 16, 8, 128, torch.bfloat16) == 2 * kv_cache.block_bytes(28, 16, 8, 128, FP8_KV_DTYPE)
    sized = {}
    for name in ("bfloat16", "fp8"):
        runner = ModelRunner(WorkerConfig(model=str(tiny_model_dir), kv_cache_dtype=name, kv_cache_memory_gb=1 / 1024,
                                          max_model_len=256))
        info = runner.describe()
        sized[name] = info.num_kv_blocks
        assert info.kv_cache_dtype == {"bfloat16": "bfloat16", "fp8": "float8_e4m3fn"}[name]
        assert info.dtype == "float32" and runner.kv_cache.dtype == resolve_kv_cache_dtype(name, torch.float32)
    # 1 MiB / (2 * 2 layers * 16 tokens * 2 kv heads * 32 dims * 2 or 1 bytes)
    assert sized == {"bfloat16": 128, "fp8": 256}


@torch.inference_mode()
def cached_logits(model, cache_dtype: torch.dtype) -> torch.Tensor:
    """Logits of three prompts computed in two chunks, the second over the cached first, so
    every attention reads keys and values back from a cache of cache_dtype."""
    config = model.config
    block_size, num_blocks = 8, 32
    kv_cache.allocate_kv_cache(model, num_blocks, block_size, config.num_key_value_heads, config.head_dim,
                               cache_dtype, torch.device("cpu"))
    bind_kv_scales(model, cache_dtype, [])
    g = torch.Generator().manual_seed(5)
    lengths = [40, 23, 61]
    tables = random_block_tables(lengths, block_size, num_blocks, g)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g) for n in lengths]
    logits = []
    for first in (True, False):
        seq_lens = [n // 2 if first else n for n in lengths]
        query_lens = [n // 2 if first else n - n // 2 for n in lengths]
        meta = paged_metadata(tables, seq_lens, query_lens, block_size)
        ids = torch.cat([p[s - q:s] for p, s, q in zip(prompts, seq_lens, query_lens)])
        hidden = model(ids, positions_of(seq_lens, query_lens), meta)
        logits.append(model.compute_logits(hidden, torch.arange(len(ids))))
    return torch.cat(logits)


def test_fp8_cache_logits_stay_close_to_the_float32_cache(tiny_model_dir):
    """Recorded in docs/PERF_NOTES.md (v11): the relative error and top-1 agreement."""
    model = tiny_model(tiny_model_dir)
    reference, fp8 = cached_logits(model, torch.float32), cached_logits(model, FP8_KV_DTYPE)
    bf16 = cached_logits(model, torch.bfloat16)
    error = ((fp8 - reference).norm() / reference.norm()).item()
    bf16_error = ((bf16 - reference).norm() / reference.norm()).item()
    top1 = (fp8.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"fp8 KV logits vs float32 KV: relative error {error:.2e} (bfloat16 KV: {bf16_error:.2e}), "
          f"top-1 agreement {top1:.3f}")
    # e4m3 keeps 3 mantissa bits to bfloat16's 7: about 16x bfloat16's error, nothing saturating.
    assert bf16_error < error < 0.1
    assert top1 >= 0.85
