"""The Triton decode kernel (triton_decode.py) against the torch reference on fresh random
inputs: pure decodes over an FP8 cache with and without split-K (merged in the last split or by
its own launch), a mixed batch whose decodes it takes apart from the tile kernel, CUDA-graph
padding rows, and a 16-bit cache; its products on tensor cores and on CUDA cores; both attention
kernels' grids in either order (LaunchConfig.heads_first). Without CUDA the kernels run under Triton's interpreter.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, gpu_faithful
from tests.unit.test_attention_backends import draw_seed, relative_error
from tests.unit.test_kv_cache_fp8 import TOLERANCE, fp8_case, kernels, reference_attention
from worker_svc.layers.attention.base import longest_first_order


@pytest.fixture(autouse=True)
def _faithful_interpreter():
    with gpu_faithful():
        yield


KERNELS = ["gqa", "gqa-fma"]   # triton_kernels.GQA (tensor cores), GQA_FMA (CUDA cores)


def gqa_launch(kv_tile: int, num_warps: int = 4, kernel: str = "gqa"):
    k = kernels()
    return k.LaunchConfig(tile_rows=16, kv_tile=kv_tile, num_warps=num_warps, num_stages=1, kernel=kernel)


def dequantized_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache's K and V as the float32 values they stand for (each kv head times its scale)."""
    return tuple(c.float() * s[None, None, :, None] for c, s in ((k_cache, scales.k), (v_cache, scales.v)))


def stored_fp8_case(seed: int, batch_kind: str, dtype: torch.dtype, group: int):
    """An FP8 case with this step's K/V already in the cache, and its reference output."""
    k = kernels()
    case, scales = fp8_case(random.Random(seed), batch_kind, dtype, group=group)
    expected, _, _ = reference_attention(case, scales)
    m = case.meta
    k.store_kv_cache(case.k, case.v, case.k_cache, case.v_cache, m.slot_mapping, scales)
    return case, scales, expected


@pytest.mark.parametrize("group,kernel,dtype", [
    (2, "gqa", torch.float32), (2, "gqa-fma", torch.bfloat16), (4, "gqa", torch.bfloat16),
    (4, "gqa-fma", torch.float32), (16, "gqa", torch.float32), (16, "gqa-fma", torch.bfloat16),
], ids=lambda v: str(v).removeprefix("torch."))
def test_the_decode_kernel_matches_the_reference_over_an_fp8_cache(dtype, group, kernel):
    """Groups narrower than, as wide as and wider than the kernel's 8 columns; every pair of
    group, kernel and dtype occurs."""
    k = kernels()
    seed = draw_seed()
    case, scales, expected = stored_fp8_case(seed, "decode", dtype, group)
    m = case.meta
    out = k.paged_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                            case.scale, pure_decode=True, num_splits=1, kv_scales=scales,
                            launch=gqa_launch(16, kernel=kernel))
    assert out.dtype == dtype and torch.isfinite(out).all(), f"seed {seed}"
    err = relative_error(out, expected)
    assert err < TOLERANCE[dtype], f"seed {seed}: relative error {err:.2e}"


@pytest.mark.parametrize("num_splits,kernel", [(2, k) for k in KERNELS] + [(8, "default")])
@pytest.mark.parametrize("fused_merge", [True, False], ids=["merge-in-last-split", "merge-kernel"])
def test_the_decode_kernel_split_merges_to_the_same_answer(num_splits, fused_merge, kernel):
    """Some splits see no key; the fused merge leaves its counters at zero for the next launch.
    "default": the launch the decode table picks for an FP8 cache (the decode kernel)."""
    k = kernels()
    seed = draw_seed()
    case, scales, expected = stored_fp8_case(seed, "decode", torch.float32, group=2 if kernel != "default" else 4)
    m = case.meta
    launch = None if kernel == "default" else gqa_launch(16, num_warps=1, kernel=kernel)
    for _ in range(2 if fused_merge else 1):   # the second launch finds the counters the first one left
        out = k.paged_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                                case.scale, pure_decode=True, num_splits=num_splits, kv_scales=scales,
                                fused_merge=fused_merge, launch=launch)
        err = relative_error(out, expected)
        assert err < TOLERANCE[torch.float32], f"seed {seed}: relative error {err:.2e}"
    if fused_merge:
        assert not k._SPLIT_COUNTERS[case.q.device].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_mixed_batch_with_its_decodes_apart_matches_the_reference(dtype):
    """The decode kernel takes the one-token requests (split, merged in their last split), the
    tile kernel the chunks; every output row is written by exactly one of them."""
    k = kernels()
    seed = draw_seed()
    case, scales, expected = stored_fp8_case(seed, "mixed", dtype, group=2)
    m = case.meta
    out = k.paged_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                            case.scale, pure_decode=False, kv_scales=scales, decodes_apart=True)
    err = relative_error(out, expected)
    assert err < TOLERANCE[dtype], f"seed {seed}: relative error {err:.2e}"
    assert not k._SPLIT_COUNTERS.get(case.q.device, torch.zeros(1)).any()


@pytest.mark.parametrize("fused_merge", [True, False], ids=["merge-in-last-split", "merge-kernel"])
def test_the_decode_kernel_leaves_zeros_for_a_padded_row(fused_merge):
    """CUDA-graph padding (seq_len 0) under split-K: every split of the row is empty (merged in
    the last split by the decode table's launch, or by the merge kernel after a given one)."""
    k = kernels()
    seed = draw_seed()
    case, scales, expected = stored_fp8_case(seed, "decode", torch.float32, group=2)
    m = case.meta
    n = m.seq_lens.shape[0]
    q = torch.cat([case.q, torch.randn_like(case.q[:1])])
    seq_lens = torch.cat([m.seq_lens, m.seq_lens.new_zeros(1)])
    tables = torch.cat([m.block_tables, m.block_tables[:1]])
    out = k.paged_attention(q, case.k_cache, case.v_cache, torch.arange(n + 2, dtype=torch.int32, device=DEVICE),
                            seq_lens, tables, case.scale, pure_decode=True, num_splits=4, kv_scales=scales,
                            fused_merge=fused_merge, launch=None if fused_merge else gqa_launch(16))
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), f"seed {seed}"
    assert relative_error(out[:n], expected) < TOLERANCE[torch.float32], f"seed {seed}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_decode_kernel_reads_a_16_bit_cache_as_the_tile_kernel_does(kernel):
    k = kernels()
    seed = draw_seed()
    case, scales, _ = stored_fp8_case(seed, "decode", torch.float32, group=2)
    m = case.meta
    k_cache, v_cache = dequantized_caches(case.k_cache, case.v_cache, scales)
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    q = case.q.to(torch.bfloat16)
    args = (q, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables, case.scale)
    tiles = k.paged_attention(*args, pure_decode=True, num_splits=1)
    gqa = k.paged_attention(*args, pure_decode=True, num_splits=1, launch=gqa_launch(32, kernel=kernel))
    err = relative_error(gqa, tiles.double().cpu())
    assert err < TOLERANCE[torch.bfloat16], f"seed {seed}: relative error {err:.2e}"


@pytest.mark.parametrize("kernel,fp8,num_splits", [("gqa", True, 1), ("gqa", True, 4), ("tiles", True, 1),
                                                   ("tiles", False, 2), ("gqa", False, 1)])
def test_a_launch_with_its_kv_heads_first_computes_the_same_bytes(kernel, fp8, num_splits):
    """LaunchConfig.heads_first reorders the grid only: every program computes what it did, in the
    default order and handed out longest first, split or not (the last split merges)."""
    k = kernels()
    seed = draw_seed()
    case, scales, _ = stored_fp8_case(seed, "decode", torch.float32, group=2)
    m = case.meta
    k_cache, v_cache = case.k_cache, case.v_cache
    if not fp8:
        k_cache, v_cache = dequantized_caches(k_cache, v_cache, scales)
        scales = None
    launch = k.LaunchConfig(tile_rows=16, kv_tile=16, num_warps=1 if kernel == "gqa" else 4, num_stages=1,
                            kernel=kernel)
    order = longest_first_order(m.seq_lens)
    for decode_order in (None, order):
        outs = [k.paged_attention(case.q, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables, case.scale,
                                  pure_decode=True, num_splits=num_splits, kv_scales=scales, decode_order=decode_order,
                                  launch=dataclasses.replace(launch, heads_first=first)) for first in (False, True)]
        assert torch.equal(outs[0], outs[1]), f"seed {seed}"


def test_the_decode_tables_launch_kv_heads_first_unless_turned_off(monkeypatch):
    k = kernels()
    for fp8 in (False, True):
        for n in (1, 16, 256):
            assert k.decode_launch(fp8, n).heads_first
    monkeypatch.setattr(k, "DECODE_HEADS_FIRST", False)
    assert not k.decode_launch(True, 256).heads_first and not k.decode_launch(False, 1).heads_first


def test_a_batch_past_the_grids_second_axis_keeps_its_requests_first():
    k = kernels()
    launch = k.decode_launch(False, 256)
    assert k._heads_first(launch, 256) and k._grid(256, 8, 1, True) == (8, 256, 1)
    assert not k._heads_first(launch, k.MAX_GRID_Y + 1)
    assert not k._heads_first(dataclasses.replace(launch, heads_first=False), 256)
