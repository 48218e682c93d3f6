"""A pure-decode attention launch that takes the raw qkv projection and does Qwen3's q/k norm, RoPE
and the K/V store itself (attention/decode_qk.py) leaves what the separate kernel and the launch after
it leave: the same attention output (up to the order of float32 sums), the same cache bytes (but
where that order flips a rounding), and the projection untouched. Over both attention kernels (the
tile kernel the bf16 table picks, the decode kernel an FP8 cache's picks, on tensor cores and on
CUDA cores), split-K merged in the last split or by its own launch, a CUDA-graph padding row, and
the whole model's decode step through attend_qkv. Without CUDA the kernels run under Triton's interpreter.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, gpu_faithful
from tests.unit.test_attention_backends import decode_batch, draw_seed, random_case, relative_error
from tests.unit.test_kv_cache_fp8 import TOLERANCE, _norm, assert_nearly_identical, fp8_case, kernels, \
    rope_operand_size

pytest.importorskip("triton", reason="triton is not installed")


@pytest.fixture(autouse=True)
def _faithful_interpreter():
    with gpu_faithful():
        yield


def decode_step(seed: int, dtype: torch.dtype, fp8: bool, group: int, head_dim: int, pad: bool, batch: int = 3):
    """(the case, its scales or None, qkv, q_norm, k_norm, cos_sin): a random pure-decode step of
    `batch` requests (an FP8 cache's: fp8_case's; contexts of 0..40 tokens before the new one), its
    projection, and for `pad` one more request as CUDA-graph padding (length 0, slot -1)."""
    rng = random.Random(seed)
    context_lens, query_lens = decode_batch(rng, 40, batch)
    if fp8:
        case, scales = fp8_case(rng, "decode", dtype, group=group)
    else:
        case = random_case(rng, context_lens=context_lens, query_lens=query_lens, num_kv_heads=2, group=group,
                           head_dim=head_dim, block_size=16, dtype=dtype)
        scales = None
        case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    m = case.meta
    if pad:
        m = dataclasses.replace(
            m, slot_mapping=torch.cat([m.slot_mapping, m.slot_mapping.new_full((1,), -1)]),
            query_start_loc=torch.arange(m.seq_lens.shape[0] + 2, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.cat([m.seq_lens, m.seq_lens.new_zeros(1)]),
            block_tables=torch.cat([m.block_tables, m.block_tables[:1]]))
        case = dataclasses.replace(case, meta=m)
    num_tokens, num_heads, head_dim = m.seq_lens.shape[0], case.q.shape[1], case.q.shape[2]
    num_kv_heads = case.k_cache.shape[2]
    g = torch.Generator().manual_seed(seed)
    q_norm, k_norm = _norm(head_dim, 1e-6, g, dtype), _norm(head_dim, 1e-5, g, dtype)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 2).to(dtype)
    angles = torch.randint(0, 4096, (num_tokens, 1), generator=g) * torch.rand(head_dim // 2, generator=g)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return case, scales, qkv, q_norm, k_norm, cos_sin


CASES = [   # (dtype, fp8 cache, launch kernel or None for the table's, splits, fused merge, pad, requests)
    (torch.float32, False, None, 1, True, False, 1),   # one row: its q view's row stride is not the projection's
    (torch.bfloat16, False, None, 8, True, False, 1),
    (torch.float32, False, None, 1, True, False, 3),
    (torch.bfloat16, False, None, 4, True, True, 3),
    (torch.float32, False, None, 4, False, False, 3),
    (torch.bfloat16, True, None, 1, True, True, 3),
    (torch.float32, True, "gqa", 4, True, False, 3),
    (torch.bfloat16, True, "gqa-fma", 4, False, True, 3),
    (torch.bfloat16, False, "gqa", 2, True, False, 3),
]


@pytest.mark.parametrize("dtype,fp8,kernel,splits,fused_merge,pad,requests", CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_the_launch_from_the_raw_projection_leaves_what_the_separate_kernel_leaves(dtype, fp8, kernel, splits,
                                                                                      fused_merge, pad, requests):
    k = kernels()
    from worker_svc.layers.attention import qkv_store
    from worker_svc.layers.attention.decode_qk import DecodeQK

    seed = draw_seed()   # (ATTN_TEST_SEED=seed reruns a failure)
    case, scales, qkv, q_norm, k_norm, cos_sin = decode_step(seed, dtype, fp8, group=2, head_dim=32, pad=pad,
                                                             batch=requests)
    m = case.meta
    num_heads, num_kv_heads, head_dim = case.q.shape[1], case.k_cache.shape[2], case.q.shape[2]
    weights = (q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE))
    launch = None
    if kernel is not None:
        launch = k.LaunchConfig(tile_rows=16, kv_tile=16, num_warps=1, num_stages=1, kernel=kernel)
    common = dict(pure_decode=True, num_splits=splits, kv_scales=scales, launch=launch, fused_merge=fused_merge)

    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    q = qkv_store.qk_norm_rope_store(qkv.clone().to(DEVICE), *weights, q_norm.eps, k_norm.eps, cos_sin.to(DEVICE),
                                     num_heads, num_kv_heads, k_ref, v_ref, m.slot_mapping, scales)
    expected = k.paged_attention(q, k_ref, v_ref, m.query_start_loc, m.seq_lens, m.block_tables, case.scale, **common)

    packed = qkv.to(DEVICE)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    raw_q = packed[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    qk = DecodeQK(packed, *weights, q_norm.eps, k_norm.eps, cos_sin.to(DEVICE), m.slot_mapping)
    out = k.paged_attention(raw_q, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables, case.scale,
                            qk=qk, **common)

    assert torch.equal(packed.cpu(), qkv), f"seed {seed}: the projection was written"
    err = relative_error(out, expected.double().cpu())
    assert err < TOLERANCE[dtype], f"seed {seed}: relative error {err:.2e}"
    if pad:
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), f"seed {seed}: the padding row"
    k_width = slice(num_heads * head_dim, (num_heads + num_kv_heads) * head_dim)
    k_size = rope_operand_size(k_norm(qkv[:, k_width].view(-1, num_kv_heads, head_dim)), cos_sin)
    if scales is not None:
        k_size = k_size * scales.k_inv.cpu()[:, None]
    k_size_cache = torch.zeros(k_ref.shape)
    slots = m.slot_mapping.cpu()
    kept = slots >= 0
    k_size_cache.view(-1, num_kv_heads, head_dim)[slots[kept]] = k_size[kept]
    assert_nearly_identical(k_cache.cpu(), k_ref.cpu(), f"the K cache (seed {seed})", k_size_cache)
    assert_nearly_identical(v_cache.cpu(), v_ref.cpu(), f"the V cache (seed {seed})")
    assert not k._SPLIT_COUNTERS.get(out.device, torch.zeros(1)).any()


def test_a_mixed_step_is_refused_the_raw_projection():
    k = kernels()
    from worker_svc.layers.attention.decode_qk import DecodeQK

    case, scales, qkv, q_norm, k_norm, cos_sin = decode_step(3, torch.float32, False, 2, 32, False)
    m = case.meta
    packed = qkv.to(DEVICE)
    num_heads, head_dim = case.q.shape[1], case.q.shape[2]
    qk = DecodeQK(packed, q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE), 1e-6, 1e-6, cos_sin.to(DEVICE),
                  m.slot_mapping)
    raw_q = packed[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    with pytest.raises(AssertionError, match="pure-decode"):
        k.paged_attention(raw_q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                          case.scale, pure_decode=False, qk=qk)
    with pytest.raises(AssertionError, match="q part"):   # q copied out of the projection: not its own
        k.paged_attention(raw_q.clone(), case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                          case.scale, pure_decode=True, qk=qk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_decode_step_of_the_model_takes_its_projection_straight_into_attention(tiny_model_dir, dtype):
    """The tiny Qwen3 over the Triton backend, one pure-decode step: with the launch taking the raw
    projection every layer's attention goes through attend_decode_qk and no layer runs the separate
    kernel; the logits and the caches are the separate kernel's. A step of more rows than the bound
    (decode_qk.MAX_ROWS) runs the separate kernel."""
    kernels()
    from tests.support.worker_batches import paged_metadata, positions_of, random_block_tables, tiny_qwen3_with_cache
    from worker_svc.layers.attention import decode_qk, qkv_store
    from worker_svc.layers.attention.triton_backend import TritonAttentionBackend
    from worker_svc.model_config import load_model_config

    block_size, num_blocks = 8, 32
    g = torch.Generator().manual_seed(21)
    seq_lens = [12, 1, 30]   # one decode after a prompt of one token
    block_tables = random_block_tables(seq_lens, block_size, num_blocks, g)

    def run(max_rows: int) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, int]]:
        model = tiny_qwen3_with_cache(tiny_model_dir, dtype, DEVICE, num_blocks, block_size)
        layers = model.attention_layers()
        for layer in layers:
            layer.backend = TritonAttentionBackend()
            for cache in (layer.k_cache, layer.v_cache):   # an earlier step's keys and values
                cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(5)).to(cache.dtype))
        meta = paged_metadata(block_tables, seq_lens, [1, 1, 1], block_size)
        meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(DEVICE) for f in dataclasses.fields(meta)
                                            if torch.is_tensor(getattr(meta, f.name))})
        input_ids = torch.randint(0, load_model_config(tiny_model_dir).vocab_size, (3,), generator=torch.Generator().manual_seed(7)).to(DEVICE)
        calls = {"separate": 0, "raw": 0}
        with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
            patch.setattr(decode_qk, "MAX_ROWS", max_rows)
            store, attend = qkv_store.qk_norm_rope_store, TritonAttentionBackend.attend_decode_qk
            patch.setattr(qkv_store, "qk_norm_rope_store",
                          lambda *a, **kw: calls.__setitem__("separate", calls["separate"] + 1) or store(*a, **kw))
            patch.setattr(TritonAttentionBackend, "attend_decode_qk",
                          lambda *a, **kw: calls.__setitem__("raw", calls["raw"] + 1) or attend(*a, **kw))
            if DEVICE.type == "cpu":   # the layers pick the Triton paths for CUDA tensors only
                patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            hidden = model(input_ids, positions_of(seq_lens, [1, 1, 1]).to(DEVICE), meta)
            logits = model.compute_logits(hidden, torch.arange(3, device=DEVICE)).float().cpu()
        return logits, [c.cpu() for layer in layers for c in (layer.k_cache, layer.v_cache)], calls

    (expected, expected_caches, separate), (actual, caches, raw) = run(0), run(3)
    num_layers = len(expected_caches) // 2
    assert separate == {"separate": num_layers, "raw": 0} and raw == {"separate": 0, "raw": num_layers}
    assert run(2)[2] == separate   # three rows over a bound of two
    error = ((actual - expected).norm() / expected.norm()).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error
    for got, want in zip(caches, expected_caches):
        # a rounding step of the value or of RoPE's operands (normed keys: a few units at most here)
        assert_nearly_identical(got, want, "a layer's cache", want.float().abs() + 4.0)
