"""The FP8 KV cache's kernels against torch references that quantize the same way, on fresh
random inputs: the Triton store writes the bytes kv_quant.quantize writes; the Triton attention
over an FP8 cache equals float64 attention over the dequantized cache up to float rounding
(decode and mixed prefill/decode batches; split-K and its merges: test_triton_decode_kernel.py); the fused q/k norm + RoPE + store kernel leaves the cache and q as
the unfused path does (norm_and_rotate_qkv, then the store), for FP8, bfloat16 and same-dtype
caches. Without CUDA the kernels run under Triton's interpreter, made to round like a GPU.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, gpu_faithful
from tests.unit.test_attention_backends import decode_batch, draw_seed, mixed_batch, random_case, relative_error
from worker_svc.layers.attention.kv_quant import FP8_KV_DTYPE, FP8_KV_MAX, KVScales, dequantize, quantize
from worker_svc.layers.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from worker_svc.layers.layernorm import RMSNorm
from worker_svc.layers.rotary import norm_and_rotate_qkv

MAX_CONTEXT, MAX_CHUNK, DECODE_BATCH = (40, 12, 3) if DEVICE.type == "cpu" else (3000, 700, 48)
# Relative L2 error against float64 attention over the same dequantized values.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _faithful_interpreter():
    with gpu_faithful():
        yield


def kernels():
    return pytest.importorskip("worker_svc.layers.attention.triton_kernels", reason="triton is not installed")


def random_scales(num_kv_heads: int, generator: torch.Generator) -> KVScales:
    """Per-head scales a few orders of magnitude apart, so a kernel that mixes up heads shows."""
    k = torch.exp(torch.randn(num_kv_heads, generator=generator)) * 0.01
    v = torch.exp(torch.randn(num_kv_heads, generator=generator)) * 0.01
    return KVScales.of(k, v).to(DEVICE)


def fp8_case(rng: random.Random, batch_kind: str, dtype: torch.dtype, group: int = 2, num_kv_heads: int = 2):
    """A random paged step (tests/unit/test_attention_backends.py) with its cache quantized, and
    its scales: the unowned slots hold zeros (FP8 has no NaN to poison them with)."""
    context_lens, query_lens = (mixed_batch(rng, MAX_CONTEXT, MAX_CHUNK) if batch_kind == "mixed"
                                else decode_batch(rng, MAX_CONTEXT, DECODE_BATCH))
    case = random_case(rng, context_lens=context_lens, query_lens=query_lens, num_kv_heads=num_kv_heads,
                       group=group, head_dim=32, block_size=16, dtype=dtype)
    scales = random_scales(num_kv_heads, torch.Generator().manual_seed(rng.randrange(2**31)))
    # Values around 50x the scale: e4m3's normal range, with some saturating at 448.
    for name, inv in (("k_cache", scales.k_inv), ("v_cache", scales.v_inv)):
        cache = getattr(case, name)
        values = cache.float().nan_to_num(0.0) * 50.0 / inv[None, None, :, None]
        setattr(case, name, quantize(values.flatten(0, 1), inv).view(cache.shape))
    case.k, case.v = case.k * 50 * scales.k[:, None].to(dtype), case.v * 50 * scales.v[:, None].to(dtype)
    return case, scales


def reference_attention(case, scales: KVScales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, k_cache, v_cache) of the torch backend on CPU copies: the store quantizes (the
    bytes every writer must produce), then float64 attention over the dequantized cache."""
    k_cache, v_cache = case.k_cache.cpu().clone(), case.v_cache.cpu().clone()
    meta = case.to(torch.device("cpu")).meta
    cpu_scales = scales.to("cpu")
    write_kv_cache(case.k.cpu(), case.v.cpu(), k_cache, v_cache, meta.slot_mapping, cpu_scales)
    out = TorchAttentionBackend().attend(case.q.cpu().double(), k_cache, v_cache, meta, case.scale, cpu_scales)
    return out, k_cache, v_cache


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype
    assert torch.equal(actual.cpu().view(torch.uint8), expected.view(torch.uint8)), f"{what} differ"


def test_quantize_rounds_to_nearest_and_saturates_at_the_largest_e4m3():
    x = torch.tensor([[[0.3, -1000.0, 448.0, 1e-6]]])
    stored = quantize(x, torch.tensor([1.0]))
    assert stored.dtype == FP8_KV_DTYPE
    assert stored.float().tolist() == [[[0.3125, -FP8_KV_MAX, FP8_KV_MAX, 0.0]]]
    scale = torch.tensor([0.5])
    assert torch.equal(dequantize(quantize(x, 1 / scale), scale, torch.float32),
                       (x / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE).float() * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch_kind", ["decode", "mixed"])
def test_triton_store_and_attention_over_an_fp8_cache_match_the_torch_reference(batch_kind, dtype):
    kernels()
    backend = pytest.importorskip("worker_svc.layers.attention.triton_backend").TritonAttentionBackend()
    seed = draw_seed()
    case, scales = fp8_case(random.Random(seed), batch_kind, dtype)
    expected, k_expected, v_expected = reference_attention(case, scales)
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, scales)
    assert out.dtype == dtype and torch.isfinite(out).all(), f"seed {seed}"
    assert_same_bytes(case.k_cache, k_expected, f"seed {seed}: K caches")
    assert_same_bytes(case.v_cache, v_expected, f"seed {seed}: V caches")
    err = relative_error(out, expected)
    assert err < TOLERANCE[dtype], f"seed {seed}: relative error {err:.2e}"


def test_an_fp8_cache_without_scales_is_refused():
    k = kernels()
    cache = torch.zeros(2, 16, 1, 32, dtype=FP8_KV_DTYPE, device=DEVICE)
    token = torch.zeros(1, 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="fp8 KV cache needs"):
        k.store_kv_cache(token, token, cache, cache.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE))
    meta = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="fp8 KV cache needs"):
        k.paged_attention(token, cache, cache, meta, meta[1:], meta[None, :1], 1.0, pure_decode=True)


def assert_nearly_identical(actual: torch.Tensor, expected: torch.Tensor, what: str,
                            operands: torch.Tensor | None = None) -> None:
    """float32: equal up to the order of sums; rounded types (bfloat16, e4m3): the same bits but
    for the few elements where that order flipped a rounding, and those one step apart: one step of
    the value, or where it is a sum (RoPE's x cos - y sin) one step of its `operands`' magnitude
    (|x cos| + |y sin|, rope_operand_size): a rounding of x flipped carries its step into the sum
    however near zero the sum cancels."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-6), f"{what} differ"
        return
    differing = (actual.view(torch.uint8) != expected.view(torch.uint8)).sum().item()
    # As tests/unit/test_fused_kernels.py allows: 2% (a GPU's rsqrt is not the CPU's).
    assert differing <= actual.numel() * actual.element_size() // 50 + 1, f"{differing} bytes of {what} differ"
    step = 2 ** -7 if actual.dtype == torch.bfloat16 else 2 ** -3
    size = expected.float().abs() if operands is None else torch.maximum(expected.float().abs(), operands.float())
    worst = ((actual.float() - expected.float()).abs() - step * size).max().item()
    assert worst <= 1e-6, f"{what} differ by more than a step (by {worst:.3g} past it)"


def rope_operand_size(normed: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """|x1 cos| + |x2 sin|, |x2 cos| + |x1 sin| of RoPE's halves x1, x2 (rotary.apply_rotary's sums) for
    normed [num_tokens, heads, head_dim]: the magnitude a rounding step of a RoPE output is relative to."""
    cos, sin = cos_sin.unsqueeze(1).abs().chunk(2, dim=-1)
    x1, x2 = normed.float().abs().chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _norm(width: int, eps: float, generator: torch.Generator, dtype: torch.dtype) -> RMSNorm:
    layer = RMSNorm(width, eps).to(dtype)
    layer.weight.copy_(torch.randn(width, generator=generator) * 0.5 + 1.0)
    return layer


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (6, 1, 24)])
@pytest.mark.parametrize("model_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.bfloat16, FP8_KV_DTYPE), (torch.float32, FP8_KV_DTYPE)], ids=lambda d: str(d).removeprefix("torch."))
def test_fused_qk_norm_rope_store_leaves_what_the_unfused_path_leaves(model_dtype, cache_dtype, num_heads,
                                                                        num_kv_heads, head_dim):
    """q in place and the cache's bytes: the unfused path's (the torch layers, then the torch
    store), except where a float32 sum's order flips a rounding (a few elements at most)."""
    store = pytest.importorskip("worker_svc.layers.attention.qkv_store", reason="triton is not installed")
    seed = draw_seed()   # (ATTN_TEST_SEED=seed reruns a failure)
    g = torch.Generator().manual_seed(seed)
    num_tokens, block_size, num_blocks = 9, 4, 6
    q_norm, k_norm = _norm(head_dim, 1e-6, g, model_dtype), _norm(head_dim, 1e-5, g, model_dtype)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width, generator=g) * 2).to(model_dtype)
    angles = torch.randint(0, 4096, (num_tokens, 1), generator=g) * torch.rand(head_dim // 2, generator=g)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[3] = -1   # padding: nothing stored
    scales = random_scales(num_kv_heads, g).to("cpu") if cache_dtype == FP8_KV_DTYPE else None
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)

    q_ref, k_ref, v_ref = norm_and_rotate_qkv(qkv.clone(), q_norm, k_norm, cos_sin, num_heads, num_kv_heads)
    k_expected, v_expected = torch.zeros(cache_shape, dtype=cache_dtype), torch.zeros(cache_shape, dtype=cache_dtype)
    write_kv_cache(k_ref, v_ref, k_expected, v_expected, slots, scales)
    # RoPE's operands' magnitudes, for q and (in the cache's units, at the same slots) for K
    q_width = num_heads * head_dim
    q_size = rope_operand_size(q_norm(qkv[:, :q_width].view(num_tokens, num_heads, head_dim)), cos_sin)
    k_size = rope_operand_size(k_norm(qkv[:, q_width:q_width + num_kv_heads * head_dim]
                                      .view(num_tokens, num_kv_heads, head_dim)), cos_sin)
    if scales is not None:
        k_size = k_size * scales.k_inv.cpu()[:, None]
    k_size_cache = torch.zeros(cache_shape)
    write_kv_cache(k_size, k_size, k_size_cache, torch.zeros(cache_shape), slots)

    packed = qkv.to(DEVICE)
    k_cache = torch.zeros(cache_shape, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = store.qk_norm_rope_store(packed, q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE), q_norm.eps, k_norm.eps,
                                 cos_sin.to(DEVICE), num_heads, num_kv_heads, k_cache, v_cache, slots.to(DEVICE),
                                 scales.to(DEVICE) if scales else None)
    assert q.shape == (num_tokens, num_heads, head_dim) and q.data_ptr() == packed.data_ptr()
    assert_nearly_identical(q.cpu(), q_ref, f"q (seed {seed})", q_size)
    assert_nearly_identical(k_cache.cpu(), k_expected, f"the K cache (seed {seed})", k_size_cache)
    # copied, or quantized from the same values
    assert_nearly_identical(v_cache.cpu(), v_expected, f"the V cache (seed {seed})")
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert not k_cache.cpu().view(-1, num_kv_heads, head_dim)[untouched].float().any(), "a slot not asked was written"
