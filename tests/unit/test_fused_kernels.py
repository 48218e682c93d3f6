"""The fused Triton kernels (worker_svc/layers/fused_kernels.py) against the layers' torch path,
which mirrors transformers, on fresh random inputs in float32 and bfloat16.

The references are the layer modules themselves run on CPU tensors (their torch path); the last
test runs the whole tiny Qwen3 with and without fusion. Without CUDA the kernels run under
Triton's CPU interpreter. bfloat16 results must match bit for bit nearly
everywhere (the kernels round where the torch path rounds; only float32 sums in another order
may flip a rounding) and within one bfloat16 step everywhere.
"""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, gpu_faithful
from tests.support.worker_batches import paged_metadata, positions_of, random_block_tables, tiny_qwen3_with_cache
from worker_svc.layers.activation import SiluAndMul
from worker_svc.layers.layernorm import RMSNorm
from worker_svc.layers.rotary import norm_and_rotate_qkv
from worker_svc.model_config import load_model_config

DTYPES = [torch.float32, torch.bfloat16]
# bfloat16 only: float32 results differ in their last bits wherever the sums' order does.
MIN_EXACT_BF16 = 0.98
# Largest difference as a fraction of the reference's magnitude: one bfloat16 step is 2**-8 of
# a value in [1, 2); float32 differs only by the order of its sums.
RELATIVE_STEP = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


@pytest.fixture(scope="module")
def fused():
    fused_kernels = pytest.importorskip("worker_svc.layers.fused_kernels", reason="triton is not installed")
    with gpu_faithful():     # interpreted, the kernels round float32 to bfloat16 as a GPU does
        yield fused_kernels


def random(*shape, generator, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """expected is the torch path's result on the CPU."""
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.bfloat16:
        exact = (actual == expected).float().mean().item()
        assert exact >= MIN_EXACT_BF16, f"only {exact:.4f} of the elements are identical"
    scale = expected.float().abs().clamp_min(1.0)
    worst = ((actual.float() - expected.float()).abs() / scale).max().item()
    assert worst <= RELATIVE_STEP[expected.dtype], f"largest relative difference {worst:.3g}"


def norm_layer(width: int, eps: float, generator, dtype) -> RMSNorm:
    layer = RMSNorm(width, eps).to(dtype)
    layer.weight.copy_(torch.randn(width, generator=generator) * 0.5 + 1.0)
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_path(fused, dtype, with_residual):
    g = torch.Generator().manual_seed(11 + with_residual)
    width = 200   # not a power of two: the kernel masks its padded columns
    layer = norm_layer(width, 1e-6, g, dtype)
    x = random(9, width, generator=g, dtype=dtype, scale=3.0)
    residual = random(9, width, generator=g, dtype=dtype, scale=3.0) if with_residual else None
    expected = layer(x, residual)
    x_dev, weight = on_device(x, layer.weight)
    actual = fused.rms_norm(x_dev, weight, layer.eps, None if residual is None else residual.to(DEVICE))
    if with_residual:
        assert torch.equal(actual[1].cpu(), expected[1])   # the sum is one rounding: always identical
        assert_matches(actual[0], expected[0])
    else:
        assert_matches(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_strided_view_keeps_its_shape(fused, dtype):
    g = torch.Generator().manual_seed(12)
    layer = norm_layer(32, 1e-6, g, dtype)
    packed = random(5, 4 * 32 + 16, generator=g, dtype=dtype)
    heads = packed[:, 16:].view(5, 4, 32)   # rows of a view, as the per-head q/k norm sees them
    actual = fused.rms_norm(packed.to(DEVICE)[:, 16:].view(5, 4, 32), layer.weight.to(DEVICE), layer.eps)
    assert actual.shape == (5, 4, 32)
    assert_matches(actual, layer(heads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_torch_path(fused, dtype):
    g = torch.Generator().manual_seed(13)
    intermediate = fused.SILU_BLOCK + 300   # two programs per row, the second one partly masked
    gate_up = random(6, 2 * intermediate, generator=g, dtype=dtype, scale=4.0)
    expected = SiluAndMul()(gate_up)
    assert_matches(fused.silu_and_mul(gate_up.to(DEVICE)), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (6, 1, 24), (2, 2, 128)])
def test_qk_norm_rope_matches_the_torch_path(fused, dtype, num_heads, num_kv_heads, head_dim):
    """Padded heads (4 + 2 of 8 rows), odd half widths (12 of 16), one kv head, Qwen3's 128."""
    g = torch.Generator().manual_seed(14 + head_dim)
    num_tokens = 7
    q_norm, k_norm = norm_layer(head_dim, 1e-6, g, dtype), norm_layer(head_dim, 1e-5, g, dtype)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = random(num_tokens, width, generator=g, dtype=dtype, scale=2.0)
    # A real cos/sin table (angles of random positions), not just any numbers.
    angles = torch.randint(0, 4096, (num_tokens, 1), generator=g) * torch.rand(head_dim // 2, generator=g)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    expected = norm_and_rotate_qkv(qkv.clone(), q_norm, k_norm, cos_sin, num_heads, num_kv_heads)

    # The projection's output is a row-strided view when it is a slice of a wider buffer.
    buffer = torch.cat([qkv, random(num_tokens, 8, generator=g, dtype=dtype)], dim=-1).to(DEVICE)
    packed, tail = buffer[:, :width], buffer[:, width:].clone()
    q_weight, k_weight, cos_sin_dev = on_device(q_norm.weight, k_norm.weight, cos_sin)
    fused.qk_norm_rope_(packed, q_weight, k_weight, q_norm.eps, k_norm.eps, cos_sin_dev, num_heads, num_kv_heads)
    q, k, v = packed.cpu().split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    assert_matches(q.reshape(num_tokens, num_heads, head_dim), expected[0])
    assert_matches(k.reshape(num_tokens, num_kv_heads, head_dim), expected[1])
    assert torch.equal(v.reshape(num_tokens, num_kv_heads, head_dim), expected[2])   # v untouched
    assert torch.equal(buffer[:, width:], tail)   # nothing written past the row's qkv


def test_empty_batches_launch_nothing(fused):
    x = torch.empty(0, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    assert fused.rms_norm(x, weight, 1e-6).shape == (0, 64)
    assert fused.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    fused.qk_norm_rope_(torch.empty(0, 4 * 16, device=DEVICE), torch.ones(16, device=DEVICE),
                        torch.ones(16, device=DEVICE), 1e-6, 1e-6, torch.empty(0, 16, device=DEVICE), 2, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_forward_with_and_without_fusion(fused, tiny_model_dir, dtype):
    """The whole model: its layers reach every kernel, thread the residual through the fused
    adds, and give the torch path's logits."""
    config = load_model_config(tiny_model_dir)
    block_size, num_blocks = 8, 32
    model = tiny_qwen3_with_cache(tiny_model_dir, dtype, DEVICE, num_blocks, block_size)
    g = torch.Generator().manual_seed(15)
    seq_lens, query_lens = [11, 4, 5], [11, 1, 5]   # two prompts and a decode over a stored prefix
    meta = paged_metadata(random_block_tables(seq_lens, block_size, num_blocks, g), seq_lens, query_lens, block_size)
    meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(DEVICE) for f in dataclasses.fields(meta)
                                        if torch.is_tensor(getattr(meta, f.name))})
    input_ids = torch.randint(0, config.vocab_size, (sum(query_lens),), generator=g).to(DEVICE)
    positions = positions_of(seq_lens, query_lens).to(DEVICE)

    from worker_svc.layers.attention import qkv_store

    def logits(use_fused: bool) -> tuple[torch.Tensor, collections.Counter]:
        calls = collections.Counter()
        with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
            patch.setattr(fused, "ENABLED", use_fused)
            for module, name in ((fused, "rms_norm"), (fused, "silu_and_mul"), (fused, "qk_norm_rope_"),
                                 (qkv_store, "qk_norm_rope_store")):
                kernel = getattr(module, name)
                patch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls.update([_n]) or _k(*a, **kw))
            if DEVICE.type == "cpu":
                # The layers pick the fused kernels for CUDA tensors only; the interpreter runs
                # them on any tensor, so here every tensor claims to be a CUDA one.
                patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            hidden = model(input_ids, positions, meta)
            result = model.compute_logits(hidden, torch.arange(len(input_ids), device=DEVICE)).float().cpu()
        return result, calls

    (reference, unfused_calls), (actual, fused_calls) = logits(False), logits(True)
    layers = config.num_hidden_layers
    assert not unfused_calls
    # q/k norm and RoPE go with the K/V store into one kernel (attention/qkv_store.py).
    assert fused_calls == {"rms_norm": 2 * layers + 1, "silu_and_mul": layers, "qk_norm_rope_store": layers}
    error = ((actual - reference).norm() / reference.norm()).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error
