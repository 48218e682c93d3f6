"""Block-wise FP8 checkpoints (worker_svc/layers/fp8.py) without a GPU: the worker's quantizer
is the checkpoint format; on the CPU an FP8 checkpoint (dense or MoE) computes exactly what
transformers computes on its dequantized weights; `--quantization fp8` of a full-precision
checkpoint gives the weights its FP8 checkpoint would; FP8 layers (the CUDA layout) hold the
checkpoint's values and scales, packed and stacked, and leave `modules_to_not_convert` alone;
formats the worker cannot run are refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.tiny_model import quantize_fp8_blocks, write_tiny_qwen3_fp8
from tests.support.hf_reference import write_dequantized_checkpoint
from tests.unit.test_moe import build_worker_model
from tests.unit.test_qwen3_model import reference_logits, run_chunks
from tests.support.worker_batches import random_block_tables
from worker_svc.layers.attention import TorchAttentionBackend
from worker_svc.layers.fp8 import (FP8_DTYPE, BlockFp8Tensor, Fp8Config, dequantize_blocks, quantize_blocks,
                                   resolve_quantization)
from worker_svc.loader import init_dummy_weights, load_safetensors
from worker_svc.model_config import load_model_config
from worker_svc.models.qwen3 import Qwen3ForCausalLM
from worker_svc.models.qwen3_moe import Qwen3MoeForCausalLM

BLOCK_SIZE, NUM_BLOCKS = 8, 64


@pytest.mark.parametrize("shape,block", [((100, 70), (32, 32)), ((256, 384), (128, 128)), ((3, 96, 64), (32, 16))])
def test_the_worker_quantizer_writes_the_checkpoint_format(shape, block):
    """Bit for bit the block-by-block reference (common.tiny_model), partial blocks, a block of
    zeros and stacked experts included; each value within half an FP8 step of the weight."""
    g = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=g) * 0.1
    weight[..., :block[0], :block[1]] = 0.0
    values, scales = quantize_blocks(weight, block)
    for matrix, v, s in zip(weight.view(-1, *shape[-2:]), values.view(-1, *shape[-2:]), scales.view(-1, *scales.shape[-2:])):
        want_values, want_scales = quantize_fp8_blocks(matrix, block)
        assert torch.equal(v.view(torch.uint8), want_values.view(torch.uint8)) and torch.equal(s, want_scales)
    assert torch.all(values[..., :block[0], :block[1]].float() == 0) and torch.isfinite(scales).all()
    # e4m3 keeps 3 mantissa bits: a rounding is off by at most 1/16 of the value; below 2^-6
    # (subnormals) the step is 2^-9 of the block scale.
    error = (dequantize_blocks(values, scales, block, torch.float32) - weight).abs()
    step = scales.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :shape[-2], :shape[-1]]
    assert torch.all(error <= weight.abs() / 16 + step * 2 ** -9 + 1e-12)


@pytest.fixture(scope="module", params=["dense", "moe"])
def fp8_checkpoint(request, tmp_path_factory):
    """(FP8 checkpoint, its dequantized copy)."""
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    fp8_dir = write_tiny_qwen3_fp8(root / "fp8", moe=request.param == "moe")
    return fp8_dir, write_dequantized_checkpoint(fp8_dir, root / "dequantized")


def test_fp8_checkpoint_on_the_cpu_is_its_dequantized_weights(fp8_checkpoint):
    """Dequantized at load, the model is transformers' on the dequantized weights, to float32
    rounding (1e-4)."""
    fp8_dir, dequantized = fp8_checkpoint
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 512, (29,), generator=g).tolist()
    [logits] = run_chunks(build_worker_model(fp8_dir), random_block_tables([29], BLOCK_SIZE, NUM_BLOCKS, g),
                          [29], [29], [prompt])
    torch.testing.assert_close(logits, reference_logits(dequantized, prompt), atol=1e-4, rtol=1e-4)


def test_quantizing_at_load_equals_the_fp8_checkpoint(tmp_path, tiny_model_dir):
    """--quantization fp8 on the dense tiny model holds exactly the weights of that model's FP8
    checkpoint in 128 x 128 blocks (tiny_model_dir is write_tiny_qwen3's defaults, as here)."""
    fp8_dir = write_tiny_qwen3_fp8(tmp_path / "fp8", weight_block_size=(128, 128))
    at_load = build_worker_model(tiny_model_dir, quantization="fp8")
    from_checkpoint = build_worker_model(fp8_dir)
    full = build_worker_model(tiny_model_dir)
    for (name, a), (_, b), (_, c) in zip(at_load.named_parameters(), from_checkpoint.named_parameters(),
                                         full.named_parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(a, c) == (".mlp." not in name and "_proj" not in name), name


def fp8_layers_model(model_dir, skip=()):
    """The model as CUDA builds it (FP8 weights and scales), here on the CPU, loaded."""
    config = load_model_config(model_dir)
    block = tuple(config.quantization_config["weight_block_size"])
    model_class = Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else Qwen3ForCausalLM
    model = model_class(config, TorchAttentionBackend(), 64, Fp8Config(block=block, kernel=True, skip=skip))
    load_safetensors(model, model_dir)
    return model


def test_fp8_layers_hold_the_checkpoint_values_and_scales(fp8_checkpoint):
    fp8_dir, _ = fp8_checkpoint
    tensors = load_file(fp8_dir / "model.safetensors")
    model = fp8_layers_model(fp8_dir)
    attention = model.model.layers[1].self_attn.qkv_proj
    parts = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    assert attention.weight.dtype == FP8_DTYPE
    assert torch.equal(attention.weight.view(torch.uint8), torch.cat([tensors[p] for p in parts]).view(torch.uint8))
    assert torch.equal(attention.weight_scale_inv, torch.cat([tensors[p + "_scale_inv"] for p in parts]))
    mlp = model.model.layers[1].mlp
    if hasattr(mlp, "experts"):   # stacked: expert 3's [gate | up] rows and their scales
        prefix = "model.layers.1.mlp.experts.3"
        gate_up = [tensors[f"{prefix}.{p}_proj.weight"] for p in ("gate", "up")]
        assert torch.equal(mlp.experts.w13_weight[3].view(torch.uint8), torch.cat(gate_up).view(torch.uint8))
        assert torch.equal(mlp.experts.w13_weight_scale_inv[3],
                           torch.cat([tensors[f"{prefix}.{p}_proj.weight_scale_inv"] for p in ("gate", "up")]))
        assert torch.equal(mlp.experts.w2_weight_scale_inv[3], tensors[f"{prefix}.down_proj.weight_scale_inv"])
        assert mlp.gate.weight.dtype == torch.float32   # the router is never quantized
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32


def test_modules_to_not_convert_stay_in_full_precision(tmp_path, fp8_checkpoint):
    """A checkpoint that keeps one projection unquantized: that layer keeps its full-precision
    weight, the others are FP8."""
    fp8_dir, dequantized = fp8_checkpoint
    tensors = load_file(fp8_dir / "model.safetensors")
    kept = "model.layers.0.self_attn.o_proj"
    tensors[f"{kept}.weight"] = load_file(dequantized / "model.safetensors")[f"{kept}.weight"]
    del tensors[f"{kept}.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", kept]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = fp8_layers_model(tmp_path, skip=("lm_head", kept))
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, tensors[f"{kept}.weight"])
    assert model.model.layers[1].self_attn.o_proj.weight.dtype == FP8_DTYPE


def test_fp8_dummy_weights_are_seeded_and_scaled(fp8_checkpoint):
    fp8_dir, _ = fp8_checkpoint
    config = load_model_config(fp8_dir)
    model_class = Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else Qwen3ForCausalLM
    models = [model_class(config, TorchAttentionBackend(), 64, Fp8Config(block=(32, 32))) for _ in range(2)]
    for model in models:
        init_dummy_weights(model, seed=4, std=0.02)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b), name
    layer = models[0].model.layers[1].self_attn.qkv_proj
    weight = dequantize_blocks(layer.weight, layer.weight_scale_inv, (32, 32), torch.float32)
    assert torch.isfinite(weight).all() and 0.015 < weight.std() < 0.025


def test_formats_the_worker_cannot_run_are_refused(tmp_path, fp8_checkpoint):
    cpu = torch.device("cpu")
    for spec, message in [({"quant_method": "gptq"}, "quant_method 'gptq'"),
                          ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
                          ({"quant_method": "fp8"}, "per-tensor FP8"),
                          ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
                           "activation_scheme 'static'")]:
        with pytest.raises(ValueError, match=message):
            resolve_quantization(_Config(spec), None, cpu)
    with pytest.raises(ValueError, match="quantization 'int4'"):
        resolve_quantization(_Config(None), "int4", cpu)
    # An FP8 weight without its scales.
    fp8_dir, _ = fp8_checkpoint
    tensors = load_file(fp8_dir / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((fp8_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj.weight' has no 'model.layers.0.mlp"):
        build_worker_model(tmp_path)
    # Scales of another block size than config.json names.
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(load_file(fp8_dir / "model.safetensors"), tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"64x64 blocks of a \(\d+, \d+\) weight need"):
        build_worker_model(tmp_path)
    # A tensor-parallel shard that would split a block of scales.
    values, scales = quantize_blocks(torch.randn(96, 64), (32, 32))
    with pytest.raises(ValueError, match="split its 32-wide scale blocks"):
        BlockFp8Tensor(values, scales, (32, 32)).chunk(2, 0)   # 48 rows per rank


class _Config:
    def __init__(self, quantization_config) -> None:
        self.quantization_config = quantization_config


@pytest.mark.parametrize("tied", [False, True])
def test_the_lm_head_in_fp8_computes_from_its_block_quantized_weight(monkeypatch, tmp_path, tied):
    """--lm-head-dtype fp8: the head's weight quantized as the checkpoints' linear layers are (its last block of
    rows partial: 300 rows of 128-row blocks). Without FP8 tensor cores (here) the weight becomes the dequantized
    values, so the logits are those values' product; with them (kernel) the head keeps the FP8 values and scales
    as its operands, frees its bf16 weight unless the embedding shares it, and computes the same logits. Through
    startup: the model's head, its logits close to the bf16 head's (FP8's rounding)."""
    from worker_svc import startup
    from worker_svc.layers.embed_head import ParallelLMHead

    g = torch.Generator().manual_seed(61)
    weight = torch.randn(300, 256, generator=g) * 0.05
    hidden = torch.randn(5, 256, generator=g)
    values, scales = quantize_blocks(weight, (128, 128))
    expected = hidden @ dequantize_blocks(values, scales, (128, 128), torch.float32).T
    head = ParallelLMHead(300, 256)
    head.weight.data.copy_(weight)
    head.quantize_fp8((128, 128), kernel=False, shared=False)
    assert head.fp8 is None and torch.equal(head.local_logits(hidden), expected)
    head = ParallelLMHead(300, 256)
    head.weight.data.copy_(weight)
    head.quantize_fp8((128, 128), kernel=True, shared=tied)
    operands = head.operands()
    assert operands.fp8 and operands.block == (128, 128) and operands.weight.dtype == FP8_DTYPE
    assert torch.equal(operands.weight.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(operands.weight_scale, scales)
    assert head.weight.numel() == (weight.numel() if tied else 0)
    torch.testing.assert_close(head.local_logits(hidden), expected)

    from common.tiny_model import write_tiny_qwen3

    model_dir = write_tiny_qwen3(tmp_path / "tiny", tie_word_embeddings=tied)
    plain = build_worker_model(model_dir)
    model = build_worker_model(model_dir)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    startup.quantize_lm_head(model, torch.device("cpu"))
    assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)   # the embedding stays
    error = (model.lm_head.weight - plain.lm_head.weight).abs().max()
    assert 0 < error <= plain.lm_head.weight.abs().max() / 16
    states = torch.randn(5, model.lm_head.weight.shape[1], generator=g)
    logits, want = model.lm_head(states), plain.lm_head(states)
    assert (logits - want).abs().max() <= 0.05 * want.abs().max()
