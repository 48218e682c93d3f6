"""The block-scaled FP8 GEMM (worker_svc/layers/fp8_kernels.py) on fresh random inputs, and a
whole tiny FP8 model run through it. Without CUDA the kernels run under Triton's interpreter
(tests/support/triton_interpreter.py); the CUDA-graph and Qwen3-8B-shaped tests need a GPU.

Tolerances: the per-token-group quantization is torch's rounding, bit for bit. The GEMM equals
its emulation (activations quantized and dequantized, weights dequantized, product in float64)
to float32 rounding (1e-5 of the output's scale; 2^-10 on a GPU, whose FP8 tensor cores keep
about 14 bits while they sum a 128-wide block), or one bfloat16 step (2^-7) for bf16 output.
A whole model differs from transformers on the dequantized weights by its activations'
quantization only: on the tiny random models logits stay within 15% (norm of the difference
over the norm; measured 8-10%), 25% for MoE, where the quantization also moves some tokens to
other experts (measured 8-19%), and the greedy token agrees on at least 70% of positions
(measured 77-93%). Random tiny models amplify small changes far more than trained ones.
"""
from __future__ import annotations

import collections
import pathlib

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_interpreter import DEVICE, gpu_faithful
from common.tiny_model import write_tiny_qwen3_fp8
from tests.support.hf_reference import write_dequantized_checkpoint
from tests.unit.test_fp8 import fp8_layers_model
from tests.unit.test_qwen3_model import reference_logits
from tests.support.worker_batches import metadata_on, paged_metadata, positions_of, random_block_tables
from worker_svc import kv_cache
from worker_svc.layers.fp8 import dequantize_blocks, quantize_blocks
from worker_svc.model_config import load_model_config
from tests.support.markers import requires_cuda
from tests.support.kernel_checks import FP8_GEMM_VS_EMULATION, relative_error

needs_cuda = requires_cuda


@pytest.fixture(scope="module")
def fp8_kernels():
    pytest.importorskip("triton", reason="triton is not installed")
    from worker_svc.layers import fp8_kernels

    with gpu_faithful():
        yield fp8_kernels


def reference_group_quant(x: torch.Tensor, group: int, *, reciprocal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_group_quant in torch; `reciprocal`: values multiplied by the scale's reciprocal, as
    the GEMM that quantizes on load does (an FP8 step apart from the division's in rare last bits)."""
    blocks = x.float().unflatten(-1, (-1, group))
    scale = blocks.abs().amax(-1).clamp_min(1e-12) / 448.0
    scaled = blocks * (1.0 / scale)[..., None] if reciprocal else blocks / scale[..., None]
    values = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return values.flatten(-2), scale


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], *,
                    reciprocal: bool = False, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The block-FP8 GEMM emulated: x quantized per token group (reference_group_quant) and
    dequantized, times the dequantized weight, in `dtype`."""
    values, scales = reference_group_quant(x, block[1], reciprocal=reciprocal)
    x_dequantized = (values.to(dtype).unflatten(-1, (-1, block[1])) * scales[..., None].to(dtype)).flatten(-2)
    return x_dequantized @ dequantize_blocks(weight, scale, block, dtype).T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,group", [(128 * 20, 128), (96, 32)])
def test_token_group_quant_is_torch_rounding(fp8_kernels, dtype, width, group):
    """20 groups of 128: two programs per row, the second partly masked."""
    g = torch.Generator().manual_seed(31)
    x = (torch.randn(7, width, generator=g) * 3).to(dtype)
    x[2, :group] = 0.0   # a group of zeros
    values, scales = fp8_kernels.per_token_group_quant(x.to(DEVICE), group)
    want_values, want_scales = reference_group_quant(x, group)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_scales)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,width,block,bias", [
    (1, 200, 256, (128, 128), False),    # decode; a partial last row block of the weight
    (20, 96, 64, (32, 32), True),        # a tiny model's shapes, with a bias
    (70, 384, 256, (128, 128), True),    # the prefill tiles, rows not a whole tile
])
def test_block_fp8_matmul_matches_its_emulation(fp8_kernels, out_dtype, rows, cols, width, block, bias):
    g = torch.Generator().manual_seed(32 + rows)
    weight, scale = quantize_blocks(torch.randn(cols, width, generator=g) * 0.05, block)
    x = torch.randn(rows, width, generator=g).to(out_dtype)
    b = torch.randn(cols, generator=g).to(out_dtype) if bias else None
    expected = emulated_linear(x, weight, scale, block)
    if bias:
        expected += b.double()
    actual = fp8_kernels.fp8_linear(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), block,
                                    None if b is None else b.to(DEVICE))
    assert actual.dtype == out_dtype and actual.shape == (rows, cols)
    assert relative_error(actual, expected) <= (FP8_GEMM_VS_EMULATION if out_dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("split", [2, 3, 7])
@pytest.mark.parametrize("rows", [1, 5])
def test_split_k_matches_its_emulation_and_leaves_the_counters_at_zero(fp8_kernels, split, rows):
    """K's 7 groups in 2, 3 or 7 slices (3: uneven, the last slice shorter), each activation path
    (quantized first, by a kernel upstream as an Fp8Activation, on load), with a bias: the same
    product as one program over K to float32 rounding, and the tile counters back at zero."""
    from worker_svc.layers.gemv_kernels import split_counters

    g = torch.Generator().manual_seed(40 + split + rows)
    block = (32, 32)
    weight, scale = quantize_blocks(torch.randn(96, 7 * 32, generator=g) * 0.05, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(rows, 7 * 32, generator=g).to(DEVICE)
    b = torch.randn(96, generator=g).to(DEVICE)
    tile = dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=2)
    expected = emulated_linear(x.cpu(), weight.cpu(), scale.cpu(), block) + b.cpu().double()
    for inputs in ({}, {"quantize_on_load": True}, "activation"):
        def run(config, inputs=inputs):
            if inputs == "activation":
                return fp8_kernels.fp8_linear(fp8_kernels.quantize_activation(x, block[1]), weight, scale, block, b,
                                              config=config)
            return fp8_kernels.fp8_linear(x, weight, scale, block, b, config=config, **inputs)
        whole, sliced = run(tile), run({**tile, "SPLIT_K": split})
        assert sliced.shape == (rows, 96)
        assert relative_error(sliced, whole) <= FP8_GEMM_VS_EMULATION, inputs
        if inputs != {"quantize_on_load": True}:   # on load rounds by the reciprocal (the test below)
            assert relative_error(sliced, expected) <= FP8_GEMM_VS_EMULATION, inputs
        assert not split_counters(x.device).any()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_quantizing_on_load_gives_the_quantize_first_product(fp8_kernels, out_dtype):
    """One launch instead of two: the GEMM quantizes each activation tile per token group as it
    loads it (the scales bit for bit, the values up to rare last-bit roundings)."""
    g = torch.Generator().manual_seed(36)
    block = (32, 32)
    weight, scale = (t.to(DEVICE) for t in quantize_blocks(torch.randn(96, 64, generator=g) * 0.05, block))
    x = torch.randn(20, 64, generator=g).to(out_dtype).to(DEVICE)
    b = torch.randn(96, generator=g).to(out_dtype).to(DEVICE)
    first = fp8_kernels.fp8_linear(x, weight, scale, block, b)
    on_load = fp8_kernels.fp8_linear(x, weight, scale, block, b, quantize_on_load=True)
    assert relative_error(on_load, first) <= (FP8_GEMM_VS_EMULATION if out_dtype == torch.float32 else 2 ** -7)
    # Its activations are exactly the reciprocal-multiplying reference's.
    expected = emulated_linear(x.cpu(), weight.cpu(), scale.cpu(), block, reciprocal=True) + b.cpu().double()
    assert relative_error(on_load, expected) <= (FP8_GEMM_VS_EMULATION if out_dtype == torch.float32 else 2 ** -7)
    # The down projection's SwiGLU on load too: [gate | up] in, silu(gate) * up rounded as the SwiGLU kernel
    # rounds it, then quantized: the same product as that kernel then the GEMM, bit for bit.
    from worker_svc.layers import fused_kernels

    gate_up = (torch.randn(20, 128, generator=g) * 3).to(out_dtype).to(DEVICE)
    folded = fp8_kernels.fp8_linear(gate_up, weight, scale, block, b, quantize_on_load=True, silu_mul=True)
    apart = fp8_kernels.fp8_linear(fused_kernels.silu_and_mul(gate_up), weight, scale, block, b, quantize_on_load=True)
    assert folded.shape == (20, 96) and torch.equal(folded.cpu(), apart.cpu())
    with pytest.raises(AssertionError, match="SwiGLU"):
        fp8_kernels.fp8_linear(gate_up, weight, scale, block, b, silu_mul=True)


@pytest.mark.parametrize("silu_mul", [False, True], ids=["on-load", "swiglu-on-load"])
def test_one_row_quantized_on_load_is_the_first_row_of_two(fp8_kernels, silu_mul):
    """At one row the GEMM quantizing on load takes its activation (SwiGLU's) as one row, its tile's other
    rows zero (ONE_ROW): the product is bit for bit the first row of the same call on two rows, where the
    16-row tile computes every row; swapped and plain tiles, split over K and not."""
    from worker_svc.layers.linear_candidates import FP8_SWAP_TILES, swap_rows

    g = torch.Generator().manual_seed(38)
    block = (32, 32)
    weight, scale = (t.to(DEVICE) for t in quantize_blocks(torch.randn(200, 4 * 32, generator=g) * 0.05, block))
    x = (torch.randn(2, (2 if silu_mul else 1) * 4 * 32, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    for tile in ({**FP8_SWAP_TILES[0], "BLOCK_M": swap_rows(2)}, fp8_kernels._matmul_config(2)):
        for slices in (1, 3):
            config = {**tile, "SPLIT_K": slices}
            one, two = (fp8_kernels.fp8_linear(x[:rows], weight, scale, block, quantize_on_load=True,
                                               silu_mul=silu_mul, config=config) for rows in (1, 2))
            assert torch.equal(one, two[:1]), (tile, slices)


def test_token_group_quant_lays_scales_out_for_cublas_on_request(fp8_kernels):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(37)).to(DEVICE)
    values, scales = fp8_kernels.per_token_group_quant(x, 128, rows_major_scales=True)
    want_values, want_scales = reference_group_quant(x.cpu(), 128)
    assert scales.shape == (5, 2) and scales.stride() == (1, 5)
    assert torch.equal(scales.cpu(), want_scales) and torch.equal(values.cpu().view(torch.uint8),
                                                                  want_values.view(torch.uint8))


@pytest.fixture(scope="module", params=["dense", "moe"])
def fp8_checkpoint(request, tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp(f"fp8-kernels-{request.param}")
    # Two layers: the MoE model's first is dense, its second sparse; more would repeat the same check.
    fp8_dir = write_tiny_qwen3_fp8(root / "fp8", moe=request.param == "moe", num_layers=2)
    return fp8_dir, write_dequantized_checkpoint(fp8_dir, root / "dequantized")


PROMPT_LEN = 24   # a prefill over three KV blocks, small enough for the interpreter


def test_an_fp8_model_stays_near_its_dequantized_weights(fp8_kernels, fp8_checkpoint):
    """Every projection runs the FP8 GEMM (or the FP8 experts); logits and greedy tokens stay
    within the stated tolerance of transformers on the dequantized weights."""
    fp8_dir, dequantized = fp8_checkpoint
    config = load_model_config(fp8_dir)
    with torch.device(DEVICE):
        model = fp8_layers_model(fp8_dir)
    kv_cache.allocate_kv_cache(model, 32, 8, config.num_key_value_heads, config.head_dim, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(33)
    prompt = torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=g).tolist()
    meta = paged_metadata(random_block_tables([PROMPT_LEN], 8, 32, g), [PROMPT_LEN], [PROMPT_LEN], 8)
    calls = collections.Counter()
    linear = fp8_kernels.fp8_linear
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(fp8_kernels, "fp8_linear", lambda *a, **kw: calls.update(["linear"]) or linear(*a, **kw))
        hidden = model(torch.tensor(prompt, device=DEVICE), positions_of([PROMPT_LEN], [PROMPT_LEN]).to(DEVICE),
                       metadata_on(meta, DEVICE))
        logits = model.compute_logits(hidden, torch.arange(PROMPT_LEN, device=DEVICE)).cpu()
    dense_mlps = sum(not hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert calls["linear"] == 2 * config.num_hidden_layers + 2 * dense_mlps   # qkv, o (+ gate_up, down)
    expected = reference_logits(dequantized, prompt)
    assert ((logits - expected).norm() / expected.norm()).item() <= (0.25 if dense_mlps < len(model.model.layers) else 0.15)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.7


@needs_cuda
def test_fp8_linear_replays_in_a_cuda_graph(fp8_kernels):
    g = torch.Generator().manual_seed(34)
    weight, scale = (t.cuda() for t in quantize_blocks(torch.randn(512, 1024, generator=g) * 0.05, (128, 128)))
    x = torch.randn(16, 1024, generator=g).to(torch.bfloat16).cuda()
    fp8_kernels.fp8_linear(x, weight, scale, (128, 128))   # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_kernels.fp8_linear(x, weight, scale, (128, 128))
    for seed in range(3):
        x.copy_(torch.randn(16, 1024, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        assert torch.equal(out, fp8_kernels.fp8_linear(x, weight, scale, (128, 128)))


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 64, 256])
def test_cublas_block_scaled_fp8_matches_the_emulation(fp8_kernels, rows):
    """cuBLAS's 1x128 by 128x128 block scaling (Hopper, CUDA 12.9+) on Qwen3-8B's down projection
    (token counts not a multiple of 4 are padded to one)."""
    g = torch.Generator(device="cuda").manual_seed(38)
    weight, scale = quantize_blocks(torch.randn(4096, 12288, generator=g, device="cuda") * 0.02, (128, 128))
    x = torch.randn(rows, 12288, generator=g, device="cuda").to(torch.bfloat16)
    try:
        actual = fp8_kernels.cublas_fp8_linear(x, weight, fp8_kernels.cublas_weight_scales(scale), (128, 128))
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"no block-scaled FP8 in this torch / cuBLAS: {exc}")
    expected = emulated_linear(x, weight, scale, (128, 128), dtype=torch.float32)
    assert relative_error(actual, expected) <= 2 ** -7


# Against its float64 emulation on the H100 (2026-12-05, 256 and 2,048 rows, bf16 or float32 output,
# either activation path) these shapes' largest error was 0.0041-0.0081 of the largest output, with
# the emulation in float64 and the kernel's dots in float32 (PERF_NOTES v27): the FP8 tensor cores
# sum each 128-wide block in a narrower accumulator that truncates (DeepSeek-V3's report: ~14 bits),
# an error biased one way that grows with the block's sum. A scale read for the wrong block errs by far more.
QWEN3_8B_FP8_BOUND = 2 ** -6


@pytest.mark.parametrize("tile", [dict(BLOCK_N=16, num_stages=8), dict(BLOCK_N=32, num_stages=6)])
def test_narrow_column_tiles_match_the_emulation(fp8_kernels, tile):
    """linear_candidates' narrow FP8 GEMM tiles at a few rows (16 and 32 columns: more programs,
    each over the whole of K), input quantized first, as an Fp8Activation and on load, with a
    bias: the emulation's product, as the default tile gives it."""
    from worker_svc.layers.linear_candidates import FP8_NARROW_TILES

    assert tile in FP8_NARROW_TILES
    g = torch.Generator().manual_seed(44 + tile["BLOCK_N"])
    block = (32, 32)
    weight, scale = quantize_blocks(torch.randn(80, 4 * 32, generator=g) * 0.05, block)   # 80: a partial tile
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    b = torch.randn(80, generator=g).to(DEVICE)
    for rows in (1, 3):
        x = torch.randn(rows, 4 * 32, generator=g).to(DEVICE)
        config = {**fp8_kernels._matmul_config(rows), **tile}
        expected = emulated_linear(x.cpu(), weight.cpu(), scale.cpu(), block) + b.cpu().double()
        for activation in (x, fp8_kernels.quantize_activation(x, block[1])):
            actual = fp8_kernels.fp8_linear(activation, weight, scale, block, b, config=config)
            assert actual.shape == (rows, 80)
            assert relative_error(actual, expected) <= FP8_GEMM_VS_EMULATION, (rows, type(activation).__name__)
        # quantized as loaded: the same values but for the reciprocal's rare last-bit rounding
        on_load = fp8_kernels.fp8_linear(x, weight, scale, block, b, quantize_on_load=True, config=config)
        assert relative_error(on_load, expected) <= 2 ** -7, rows


@pytest.mark.parametrize("tile", ["padded 64x64", "swapped 64", "swapped 128"])
def test_the_wgmma_tiles_at_a_few_rows_match_the_emulation(fp8_kernels, tile):
    """linear_candidates' FP8 GEMM tiles for wgmma on e4m3 at 1, 3, 17 and 40 rows: the rows padded to a
    64-row tile (up to 32 rows), or the dot swapped (the weight tile as the 64-row operand, the rows
    as swap_rows's 16-64 columns), input quantized first (an Fp8Activation, as the norms and SwiGLU
    give it; the swapped ones also on load, and with SwiGLU on load), unsplit and split over K, with a bias:
    the emulation's product, and the counters back at zero."""
    from worker_svc.layers.gemv_kernels import split_counters
    from worker_svc.layers.linear_candidates import (FP8_SWAP_TILES, FP8_WGMMA_MAX_ROWS, FP8_WGMMA_TILES,
                                                     swap_rows)

    g = torch.Generator().manual_seed(46 + len(tile))
    block = (32, 32)
    weight, scale = quantize_blocks(torch.randn(200, 4 * 32, generator=g) * 0.05, block)   # 200: a partial tile
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    b = torch.randn(200, generator=g).to(DEVICE)
    for rows in (1, 3, 17, 40):
        if tile == "padded 64x64":
            if rows > FP8_WGMMA_MAX_ROWS:
                continue
            config = FP8_WGMMA_TILES[0]
        else:
            config = {**FP8_SWAP_TILES[0 if tile == "swapped 64" else 1], "BLOCK_M": swap_rows(rows)}
        x = torch.randn(rows, 4 * 32, generator=g).to(DEVICE)
        expected = emulated_linear(x.cpu(), weight.cpu(), scale.cpu(), block) + b.cpu().double()
        gate_up = torch.randn(rows, 8 * 32, generator=g).to(DEVICE)
        for slices in (1, 3):
            actual = fp8_kernels.fp8_linear(fp8_kernels.quantize_activation(x, block[1]), weight, scale, block, b,
                                            config={**config, "SPLIT_K": slices})
            assert actual.shape == (rows, 200)
            assert relative_error(actual, expected) <= FP8_GEMM_VS_EMULATION, (rows, slices)
            if config.get("SWAP_AB"):   # quantized on load (o_proj), and with SwiGLU on load (down_proj)
                on_load = fp8_kernels.fp8_linear(x, weight, scale, block, b, quantize_on_load=True,
                                                 config={**config, "SPLIT_K": slices})
                assert relative_error(on_load, expected) <= 2 ** -7, (rows, slices)
                gate, up = gate_up.cpu().chunk(2, dim=1)
                swiglu = emulated_linear(F.silu(gate) * up, weight.cpu(), scale.cpu(), block, reciprocal=True)
                folded = fp8_kernels.fp8_linear(gate_up, weight, scale, block, b, quantize_on_load=True, silu_mul=True,
                                                config={**config, "SPLIT_K": slices})
                assert relative_error(folded, swiglu + b.cpu().double()) <= 2 ** -7, (rows, slices)
        assert not split_counters(x.device).any()
    assert [swap_rows(n) for n in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]


@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 256, 2048])
def test_qwen3_8b_shapes(fp8_kernels, rows):
    """gate_up (24576 x 4096) and down (4096 x 12288) of Qwen3-8B, bf16 activations."""
    g = torch.Generator(device="cuda").manual_seed(35)
    for cols, width in [(24576, 4096), (4096, 12288)]:
        weight, scale = quantize_blocks(torch.randn(cols, width, generator=g, device="cuda") * 0.02, (128, 128))
        x = torch.randn(rows, width, generator=g, device="cuda").to(torch.bfloat16)
        for on_load in (False, True):
            expected = emulated_linear(x, weight, scale, (128, 128), reciprocal=on_load, dtype=torch.float32)
            actual = fp8_kernels.fp8_linear(x, weight, scale, (128, 128), quantize_on_load=on_load)
            assert relative_error(actual, expected) <= QWEN3_8B_FP8_BOUND, (cols, width, on_load)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_qwen3_8b_shapes_split_over_k_as_the_selection_splits_them(fp8_kernels, rows):
    """qkv, o and down of Qwen3-8B with K split as linear_candidates.fp8_split splits it on an H100 /
    H200, input quantized ahead as the norms and SwiGLU give it: the unsplit product to float32
    rounding before the bf16 output's (the tensor cores' sums are the same, only their order
    across slices differs), in a CUDA graph replayed twice (the counters start at zero again); the
    tiles for wgmma on e4m3 too (padded to 64 rows, or swapped), split and not (the swapped ones at each of
    swap_splits' factors)."""
    from worker_svc.layers.gemv_kernels import split_counters
    from worker_svc.layers.pdl_launch import pdl_in_graphs
    from worker_svc.layers.linear_candidates import fp8_split, swap_splits, wgmma_tiles

    g = torch.Generator(device="cuda").manual_seed(37)
    for cols, width in [(6144, 4096), (4096, 4096), (4096, 12288)]:
        weight, scale = quantize_blocks(torch.randn(cols, width, generator=g, device="cuda") * 0.02, (128, 128))
        x = torch.randn(rows, width, generator=g, device="cuda").to(torch.bfloat16)
        tile = fp8_kernels._matmul_config(rows)
        split = fp8_split(cols, width, rows, tile, 132, 128)
        assert split > 1, (cols, width, rows)
        activation = fp8_kernels.quantize_activation(x, 128)
        whole = fp8_kernels.fp8_linear(activation, weight, scale, (128, 128), config=tile).float()
        sliced = fp8_kernels.fp8_linear(activation, weight, scale, (128, 128), config={**tile, "SPLIT_K": split})
        assert relative_error(sliced, whole) <= 2 ** -7, (cols, width, split)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_kernels.fp8_linear(activation, weight, scale, (128, 128), config={**tile, "SPLIT_K": split})
        for _ in range(2):
            captured.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, sliced), (cols, width, split)   # the slices' sum is in a fixed order
        assert not split_counters(x.device).any()
        if pdl_in_graphs(x.device):   # with PDL, its input quantized by the kernel just before it in the graph
            for slices, late in ((1, False), (split, False), (1, True), (split, True)):   # late: the trigger after the loop
                config = {**tile, "SPLIT_K": slices, "PDL": True, "PREFETCH": 2, "LATE_TRIGGER": late}
                graph = torch.cuda.CUDAGraph()
                fp8_kernels.fp8_linear(fp8_kernels.quantize_activation(x, 128), weight, scale, (128, 128),
                                       config=config)
                with torch.cuda.graph(graph):
                    chained = fp8_kernels.fp8_linear(fp8_kernels.quantize_activation(x, 128), weight, scale,
                                                     (128, 128), config=config)
                graph.replay()
                torch.cuda.synchronize()
                assert relative_error(chained, whole) <= 2 ** -7, (cols, width, slices)
            assert not split_counters(x.device).any()
        # the tiles for wgmma on e4m3 (the rows padded to 64, or the dot swapped), split as the selection splits them
        for wide in wgmma_tiles(rows):
            splits = (swap_splits(cols, width, rows, wide, 132, 128) if wide.get("SWAP_AB")
                      else sorted({1, fp8_split(cols, width, rows, wide, 132, 128)}))
            for slices in splits:
                product = fp8_kernels.fp8_linear(activation, weight, scale, (128, 128),
                                                 config={**wide, "SPLIT_K": slices})
                assert relative_error(product, whole) <= 2 ** -7, (cols, width, wide, slices)
                if wide.get("SWAP_AB"):   # quantized on load (o_proj and down_proj's candidates)
                    on_load = fp8_kernels.fp8_linear(x, weight, scale, (128, 128), quantize_on_load=True,
                                                     config={**wide, "SPLIT_K": slices, "PDL": True, "PREFETCH": 2})
                    assert relative_error(on_load, whole) <= 2 ** -7, (cols, width, wide, slices)
        assert not split_counters(x.device).any()


# --- the quantization fused into the kernel that produces the activation (issue 24.1) ---------

@pytest.fixture(scope="module")
def fused(fp8_kernels):
    from worker_svc.layers import fused_kernels

    return fused_kernels


def assert_same_activation(actual, values: torch.Tensor, scales: torch.Tensor) -> None:
    """actual (an Fp8Activation) holds these rows' values and scales bit for bit, its padding rows
    zeros, its scales laid out for cuBLAS."""
    rows, width = values.shape
    padded = -(-rows // 4) * 4
    assert actual.num_rows == rows and actual.values.shape == (padded, width)
    assert actual.scales.shape == (padded, scales.shape[1]) and actual.scales.stride() == (1, padded)
    assert torch.equal(actual.values[:rows].cpu().view(torch.uint8), values.cpu().view(torch.uint8))
    assert torch.equal(actual.scales[:rows].cpu(), scales.cpu())
    assert not actual.values[rows:].cpu().float().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,group", [(1, 256, 128), (6, 96, 32), (8, 384, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_the_norm_then_its_quantization(fused, dtype, rows, width, group, with_residual):
    """One kernel gives what rms_norm then per_token_group_quant give, bit for bit (96 columns:
    a partial last power-of-two block; 1 and 6 rows: padded to 4 and 8)."""
    g = torch.Generator().manual_seed(40 + rows)
    x, residual = ((torch.randn(rows, width, generator=g) * 2).to(dtype).to(DEVICE) for _ in range(2))
    weight = (torch.randn(width, generator=g) * 0.5 + 1).to(dtype).to(DEVICE)
    residual = residual if with_residual else None
    expected = fused.rms_norm(x, weight, 1e-6, residual)
    normed = expected[0] if with_residual else expected
    values, scales = fused.fp8_kernels.per_token_group_quant(normed, group)
    actual = fused.rms_norm_fp8(x, weight, 1e-6, residual, group)
    if with_residual:
        actual, total = actual
        assert torch.equal(total.cpu(), expected[1].cpu())
    assert actual.dtype == dtype
    assert_same_activation(actual, values, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,group", [(3, 96, 32), (4, 2560, 128)])
def test_silu_and_mul_fp8_is_the_activation_then_its_quantization(fused, dtype, rows, width, group):
    """2,560 columns: three programs a row, the last one partial."""
    g = torch.Generator().manual_seed(50 + rows)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 3).to(dtype).to(DEVICE)
    gate_up[0, :group] = 0.0   # a group of zeros
    values, scales = fused.fp8_kernels.per_token_group_quant(fused.silu_and_mul(gate_up), group)
    assert_same_activation(fused.silu_and_mul_fp8(gate_up, group), values, scales)


@needs_cuda
@pytest.mark.parametrize("rows", [3, 256])
def test_cublas_takes_the_norms_quantized_output(fused, rows):
    """cuBLAS's block-scaled GEMM over rms_norm_fp8's output gives what it gives over rms_norm's
    output quantized by its own kernel, bit for bit (Qwen3-8B's qkv projection)."""
    g = torch.Generator(device="cuda").manual_seed(42)
    weight, scale = quantize_blocks(torch.randn(6144, 4096, generator=g, device="cuda") * 0.02, (128, 128))
    x, residual = (torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    norm_weight = torch.rand(4096, generator=g, device="cuda").to(torch.bfloat16) + 0.5
    cublas_scales = fused.fp8_kernels.cublas_weight_scales(scale)
    try:
        expected = fused.fp8_kernels.cublas_fp8_linear(fused.rms_norm(x, norm_weight, 1e-6, residual)[0], weight,
                                                        cublas_scales, (128, 128))
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"no block-scaled FP8 in this torch / cuBLAS: {exc}")
    quantized, _ = fused.rms_norm_fp8(x, norm_weight, 1e-6, residual, 128)
    actual = fused.fp8_kernels.cublas_fp8_linear(quantized, weight, cublas_scales, (128, 128))
    assert actual.shape == (rows, 6144) and torch.equal(actual, expected)


def emulated_block_scaled_mm(values, weight, scales, cublas_scales, out_dtype):
    """fp8_kernels.block_scaled_mm in float64 on any device and block size: the CPU stand-in."""
    group = values.shape[1] // scales.shape[1]
    bn = -(-weight.shape[0] // cublas_scales.shape[1])
    a = values.double() * scales.double().repeat_interleave(group, 1)
    w_scales = cublas_scales.t()[:, :weight.shape[1] // group].double()
    w = weight.double() * w_scales.repeat_interleave(bn, 0)[:weight.shape[0]].repeat_interleave(group, 1)
    return (a @ w.T).to(out_dtype)


@pytest.mark.parametrize("gemm", ["cublas", "triton"])
def test_an_fp8_model_quantizes_in_its_norms_and_swiglu(fused, fp8_checkpoint, gemm):
    """Every FP8 projection on cuBLAS's GEMM (emulated here) or the Triton GEMM with activations
    quantized first: the model's norms and SwiGLU quantize for it, so the only quantization
    kernels left are the o projections', and the logits are those of quantizing in a kernel of
    its own, bit for bit."""
    from worker_svc.layers.linear import _ParallelLinear
    from worker_svc.layers.linear_methods import Fp8Cublas, Fp8Gemm, LinearPlan

    method = (Fp8Cublas() if gemm == "cublas"
              else Fp8Gemm.of(fused.fp8_kernels._matmul_config(PROMPT_LEN), quantize_on_load=False))

    fp8_dir, _ = fp8_checkpoint
    config = load_model_config(fp8_dir)
    with torch.device(DEVICE):
        model = fp8_layers_model(fp8_dir)
    for layer in model.modules():
        if isinstance(layer, _ParallelLinear):
            layer.plan = LinearPlan([], [], method.bind(layer.operands(), torch.float32))
    fed = {name.rsplit(".", 1)[-1] for name, layer in model.named_modules() if getattr(layer, "norm_fed", False)}
    assert fed == {"qkv_proj", "gate_up_proj"}   # what the norms feed (the selection times them on FP8 input)
    kv_cache.allocate_kv_cache(model, 32, 8, config.num_key_value_heads, config.head_dim, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(41)
    prompt = torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=g).tolist()
    meta = metadata_on(paged_metadata(random_block_tables([PROMPT_LEN], 8, 32, g), [PROMPT_LEN], [PROMPT_LEN], 8),
                       DEVICE)

    def logits(fusion: bool) -> tuple[torch.Tensor, collections.Counter]:
        calls = collections.Counter()
        with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
            patch.setattr(fused, "FP8_QUANT_FUSION", fusion)
            patch.setattr(fused.fp8_kernels, "block_scaled_mm", emulated_block_scaled_mm)
            for module, name in ((fused.fp8_kernels, "per_token_group_quant"), (fused, "rms_norm_fp8"),
                                 (fused, "silu_and_mul_fp8")):
                kernel = getattr(module, name)
                patch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls.update([_n]) or _k(*a, **kw))
            if DEVICE.type == "cpu":   # the layers pick the fused kernels for CUDA tensors only
                patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            hidden = model(torch.tensor(prompt, device=DEVICE), positions_of([PROMPT_LEN], [PROMPT_LEN]).to(DEVICE),
                           meta)
            return model.compute_logits(hidden, torch.arange(PROMPT_LEN, device=DEVICE)).cpu(), calls

    (reference, separate), (actual, fused_calls) = logits(False), logits(True)
    layers = config.num_hidden_layers
    dense_mlps = sum(not hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert separate == {"per_token_group_quant": layers + layers + 2 * dense_mlps}   # qkv, o (+ gate_up, down)
    assert fused_calls == {"per_token_group_quant": layers, "rms_norm_fp8": layers + dense_mlps,
                           "silu_and_mul_fp8": dense_mlps}
    assert torch.equal(actual, reference)


def test_the_fused_quantization_checks_itself_at_start_up(fused):
    """Start-up runs the fused kernels against the unfused ones; a fault (a kernel that fails to
    compile, or gives other values) is named, and the workers keep the separate kernels."""
    assert fused.fp8_fusion_fault(DEVICE, torch.float32) is None
    with pytest.MonkeyPatch.context() as patch:
        wrong = fused.silu_and_mul_fp8
        patch.setattr(fused, "silu_and_mul_fp8", lambda x, group: wrong(x * 2, group))
        assert "silu_and_mul_fp8 differs" in fused.fp8_fusion_fault(DEVICE, torch.float32)
        patch.setattr(fused, "rms_norm_fp8", lambda *a: (_ for _ in ()).throw(RuntimeError("no compile")))
        assert fused.fp8_fusion_fault(DEVICE, torch.float32) == "RuntimeError: no compile"


def test_a_failed_start_up_check_turns_the_fusion_off(fused, caplog):
    from worker_svc.layers import linear_methods, linear_selection

    values, scale = quantize_blocks(torch.randn(64, 128, generator=torch.Generator().manual_seed(43)), (32, 32))
    fp8 = [linear_methods.LinearOperands(values, scale, (32, 32))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "FP8_QUANT_FUSION", True)
        linear_selection._check_fp8_fusion(fp8, DEVICE, torch.float32)
        assert fused.FP8_QUANT_FUSION
        patch.setattr(fused, "fp8_fusion_fault", lambda *a: "RuntimeError: no compile")
        linear_selection._check_fp8_fusion([linear_methods.LinearOperands(values.float())], DEVICE, torch.float32)
        assert fused.FP8_QUANT_FUSION   # no FP8 layer: nothing to check
        linear_selection._check_fp8_fusion(fp8, DEVICE, torch.float32)
        assert not fused.FP8_QUANT_FUSION and "start-up check (RuntimeError: no compile)" in caplog.text


@needs_cuda
def test_steps_of_new_row_counts_compile_nothing_new(fused):
    """After steps of 4 and 16 rows (as the graphs' capture meets them), steps of other row counts
    reach no new variant of the quantizing kernels or the FP8 GEMM with the tiles a plan gave it
    (the arguments that follow the row count are not specialised on): nothing would compile
    mid-serving."""
    from worker_svc import late_compiles

    g = torch.Generator(device="cuda").manual_seed(44)
    weight, scale = quantize_blocks(torch.randn(512, 512, generator=g, device="cuda") * 0.05, (128, 128))
    norm_weight = torch.rand(512, generator=g, device="cuda").to(torch.bfloat16) + 0.5
    tiles = fused.fp8_kernels._matmul_config(16)   # a plan's: one tile setting for a bucket of row counts

    def step(rows: int) -> None:
        x, residual = (torch.randn(rows, 512, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
        normed, _ = fused.rms_norm_fp8(x, norm_weight, 1e-6, residual, 128)
        activated = fused.silu_and_mul_fp8(torch.cat([x, residual], 1), 128)
        for quantized in (normed, activated, fused.fp8_kernels.quantize_activation(x, 128)):
            fused.fp8_kernels.fp8_linear(quantized, weight, scale, (128, 128), config=tiles)
        fused.fp8_kernels.fp8_linear(x, weight, scale, (128, 128), config=tiles)
        fused.fp8_kernels.fp8_linear(x, weight, scale, (128, 128), quantize_on_load=True, config=tiles)

    for rows in (4, 16):
        step(rows)
    torch.cuda.synchronize()
    assert late_compiles.watch_late_compiles()
    try:
        for rows in (5, 8, 12, 13, 17, 31, 64):
            step(rows)
        torch.cuda.synchronize()
        assert late_compiles.late_compiles() == 0
    finally:
        late_compiles.stop_watching()
