"""The fused MoE kernels (worker_svc/layers/moe_kernels.py) against the reference expert loop
(worker_svc/layers/moe.py) on fresh random inputs: routing, the sort by expert, bf16/float32
experts and FP8 experts, and a whole tiny Qwen3-MoE with and without them. Without CUDA they
run under Triton's interpreter (tests/support/triton_interpreter.py); the CUDA-graph test and the
Qwen3-30B-A3B-shaped one run on a GPU only.

Tolerances: float32 matches to 1e-5 (only the order of sums differs). bfloat16 differs from the
loop by the rounding of a token's k expert outputs (summed in float32 and rounded once, where
the loop rounds after each add): within 2^-7 of the output's scale. FP8 matches its own
emulation (activations quantized per token group, then the same float32 products) to 1e-5
(2^-10 on a GPU, whose FP8 tensor cores keep about 14 bits while they sum a 128-wide block), and
the dequantized weights' result to 10% of the output's scale: two activation quantizations with
3 mantissa bits each put random data that far from full precision (measured: 4-6%).
"""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, gpu_faithful
from tests.support.worker_batches import paged_metadata, positions_of, random_block_tables
from common.tiny_model import write_tiny_qwen3_moe
from worker_svc import kv_cache
from worker_svc.layers import moe
from worker_svc.layers.attention import TorchAttentionBackend
from worker_svc.layers.fp8 import dequantize_blocks, quantize_blocks
from worker_svc.loader import load_safetensors
from worker_svc.model_config import load_model_config
from worker_svc.models.qwen3_moe import Qwen3MoeForCausalLM
from tests.support.markers import requires_cuda
from tests.support.kernel_checks import FP8_GEMM_VS_EMULATION, every_e4m3_byte, relative_error

needs_cuda = requires_cuda


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton", reason="triton is not installed")
    from worker_svc.layers import fp8_kernels, moe_kernels

    with gpu_faithful():
        yield moe_kernels, fp8_kernels


def experts(num_experts: int, hidden: int, intermediate: int, dtype, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Random w13 [E, 2I, H] and w2 [E, H, I] whose outputs stay around 1."""
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_the_reference(kernels, dtype, renormalize):
    moe_kernels, _ = kernels
    g = torch.Generator().manual_seed(21)
    logits = (torch.randn(11, 24, generator=g) * 2).to(dtype)   # 24 experts: a padded row of 32
    weights, ids = moe_kernels.route_topk(logits.to(DEVICE), 5, renormalize)
    want_weights, want_ids = moe.route(logits, 5, renormalize)
    ids = ids.long().cpu()
    # Equal probabilities (frequent in bfloat16) may be taken in either order: compare the
    # probabilities chosen, slot by slot, and that each row's experts are distinct.
    probs = torch.softmax(logits.float(), -1)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, want_ids))
    assert all(len(set(row)) == 5 for row in ids.tolist())
    # float32 up to the exp's last bits; bfloat16 up to one rounding step flipped by them
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(weights.cpu(), want_weights, atol=0, rtol=tolerance)


def test_sort_by_expert_lists_every_assignment_once_in_its_experts_blocks(kernels):
    moe_kernels, _ = kernels
    g = torch.Generator().manual_seed(22)
    num_experts, block_m = 16, 16
    topk_ids = torch.randint(0, 11, (23, 4), generator=g, dtype=torch.int32)   # experts 11..15 idle
    sorted_ids, block_expert, num_padded = (t.cpu() for t in moe_kernels.sort_by_expert(topk_ids.to(DEVICE),
                                                                                      num_experts, block_m))
    n = topk_ids.numel()
    counts = torch.bincount(topk_ids.flatten().long(), minlength=num_experts)
    assert num_padded.item() == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert len(block_expert) == moe_kernels.max_blocks(n, num_experts, block_m) == len(sorted_ids) // block_m
    used = sorted_ids[:num_padded.item()]
    assert sorted(used[used < n].tolist()) == list(range(n))     # each assignment exactly once
    assert torch.all(sorted_ids[num_padded.item():] == n)        # the rest is sentinels
    flat = topk_ids.flatten()
    for b in range(num_padded.item() // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        assert torch.all(flat[rows[rows < n].long()] == block_expert[b]), f"block {b}"
    assert 0 <= block_expert.min() and block_expert.max() < num_experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 6, 67])
def test_fused_experts_match_the_reference_loop(kernels, dtype, num_tokens):
    """One token (decode), a few, and enough that experts get several row blocks; an
    intermediate width (48) that is not a whole K tile."""
    moe_kernels, _ = kernels
    g = torch.Generator().manual_seed(23 + num_tokens)
    w13, w2 = experts(8, 64, 48, dtype, g)
    x = torch.randn(num_tokens, 64, generator=g).to(dtype)
    weights, ids = moe.route(torch.randn(num_tokens, 8, generator=g).to(dtype), 3, True)
    expected = moe.moe_reference(x, w13, w2, weights, ids)
    x_dev, w13_dev, w2_dev, weights_dev, ids_dev = (t.to(DEVICE) for t in (x, w13, w2, weights, ids))
    actual = moe_kernels.fused_experts(x_dev, w13_dev, w2_dev, weights_dev, ids_dev)
    assert actual.dtype == dtype and actual.shape == expected.shape
    assert relative_error(actual, expected) <= (1e-5 if dtype == torch.float32 else 2 ** -7)


def _quantize_dequantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through per-token-group FP8 and back, in float32 (what the kernels feed their GEMMs)."""
    blocks = x.float().unflatten(-1, (-1, group))
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return ((blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).flatten(-2)


def _w8a8_reference(x, w13, w2, weights, ids, group):
    """moe_reference with activations quantized per token group before each projection."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = ids[t, slot]
            gate, up = (_quantize_dequantize(x[t:t + 1], group) @ w13[e].T).chunk(2, -1)
            act = torch.nn.functional.silu(gate) * up
            out[t] += (_quantize_dequantize(act, group) @ w2[e].T)[0] * weights[t, slot]
    return out


@pytest.mark.parametrize("activations,block", [("given", (32, 32)), ("given", (128, 128)), ("on_load", (32, 32)),
                                               ("weight_only", (32, 32)), ("given_m64", (32, 32)),
                                               ("on_load_swap", (32, 32)), ("given_swap", (32, 32))])
def test_fp8_experts_match_their_emulation_and_stay_near_full_precision(kernels, activations, block):
    """FP8 x FP8 (activations quantized first, or as the GEMM loads them: the same values up to
    the rare last-bit rounding of a reciprocal; either on wgmma's tiles, the WIDE_MODES) matches
    its emulation; weight-only matches the loop over the dequantized weights as an unquantized
    model does."""
    moe_kernels, _ = kernels
    g = torch.Generator().manual_seed(24)
    hidden, intermediate = 2 * block[1], block[0]   # two K blocks of each GEMM
    w13, w2 = experts(8, hidden, intermediate, torch.float32, g)
    (q13, s13), (q2, s2) = quantize_blocks(w13, block), quantize_blocks(w2, block)
    d13, d2 = dequantize_blocks(q13, s13, block, torch.float32), dequantize_blocks(q2, s2, block, torch.float32)
    x = torch.randn(9, hidden, generator=g)
    weights, ids = moe.route(torch.randn(9, 8, generator=g), 2, False)
    actual = moe_kernels.fused_experts(*(t.to(DEVICE) for t in (x, q13, q2, weights, ids)),
                                       w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE), block=block,
                                       fp8_activations=activations)
    dequantized = moe.moe_reference(x, d13, d2, weights, ids)
    if activations == "weight_only":
        assert relative_error(actual, dequantized) <= FP8_GEMM_VS_EMULATION
    else:
        assert relative_error(actual, _w8a8_reference(x, d13, d2, weights, ids, block[1])) <= FP8_GEMM_VS_EMULATION
        assert relative_error(actual, dequantized) <= 0.1


def test_the_wide_modes_run_the_plain_activations_on_their_tiles(kernels, monkeypatch):
    """given_m64: the GEMMs get the plain mode's activations and 64-row blocks (the routing padded to
    them); on_load_swap and given_swap: 16-row blocks, the dot swapped; the plain modes keep
    moe_config's rows-per-expert tiles, unswapped."""
    moe_kernels, _ = kernels
    block = (32, 32)
    g = torch.Generator().manual_seed(25)
    w13, w2 = experts(8, 64, 32, torch.float32, g)
    (q13, s13), (q2, s2) = quantize_blocks(w13, block), quantize_blocks(w2, block)
    x = torch.randn(3, 64, generator=g)
    weights, ids = moe.route(torch.randn(3, 8, generator=g), 2, False)
    calls, real = [], moe_kernels.grouped_gemm

    def spy(*args, **kwargs):
        calls.append((args[7]["BLOCK_M"], args[7].get("SWAP_AB", False), kwargs["fp8_activations"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_kernels, "grouped_gemm", spy)
    for mode in ("on_load", "given", *moe_kernels.WIDE_MODES):
        calls.clear()
        moe_kernels.fused_experts(*(t.to(DEVICE) for t in (x, q13, q2, weights, ids)), w13_scale=s13.to(DEVICE),
                                  w2_scale=s2.to(DEVICE), block=block, fp8_activations=mode)
        block_m, swap = (64, False) if mode.endswith("_m64") else (16, mode.endswith("_swap"))
        assert calls == [(block_m, swap, mode.removesuffix("_m64").removesuffix("_swap"))] * 2, mode


def test_weight_only_experts_take_fp8_weights_by_their_bits_bit_for_bit(kernels, monkeypatch):
    """bfloat16 activations against FP8 experts, weight-only: each weight as a bfloat16 2^-120 of its
    value by moving bits (activations x 2^64, products x 2^56) gives the converted weights' output
    exactly, over every e4m3 byte (zeros, subnormals, both signs) in the experts' weights."""
    moe_kernels, _ = kernels
    g = torch.Generator().manual_seed(25)
    block, hidden, intermediate, num_experts = (32, 32), 64, 32, 4
    q13 = every_e4m3_byte((num_experts, 2 * intermediate, hidden), g).to(DEVICE)
    q2 = every_e4m3_byte((num_experts, hidden, intermediate), g).to(DEVICE)
    s13 = (torch.rand(num_experts, 2 * intermediate // 32, hidden // 32, generator=g) * 1e-3 + 1e-5).to(DEVICE)
    s2 = (torch.rand(num_experts, hidden // 32, intermediate // 32, generator=g) * 1e-3 + 1e-5).to(DEVICE)
    x = torch.randn(5, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    weights, ids = moe.route(torch.randn(5, num_experts, generator=g), 2, False)

    def run():
        return moe_kernels.fused_experts(x, q13, q2, weights.to(DEVICE), ids.to(DEVICE), w13_scale=s13, w2_scale=s2,
                                         block=block, fp8_activations="weight_only")

    assert moe_kernels.WEIGHT_BITS
    by_bits = run()
    monkeypatch.setattr(moe_kernels, "WEIGHT_BITS", False)
    converted = run()
    assert torch.isfinite(converted.float()).all() and torch.equal(by_bits, converted)


def test_fp8_experts_take_bf16_activations_while_few_rows_reach_each_expert(kernels):
    moe_kernels, _ = kernels
    assert moe_kernels.default_fp8_activations(256 * 8, 128) == "weight_only"    # a decode of 256 tokens
    assert moe_kernels.default_fp8_activations(2048 * 8, 128) == "on_load"       # a prompt


def test_a_tiny_qwen3_moe_with_and_without_the_fused_path(kernels, tmp_path):
    """The whole model: every sparse layer reaches fused_moe, and the logits are the loop's."""
    moe_kernels, _ = kernels
    model_dir = write_tiny_qwen3_moe(tmp_path / "moe", num_layers=3, mlp_only_layers=(0,))
    config = load_model_config(model_dir)
    with torch.device(DEVICE):
        model = Qwen3MoeForCausalLM(config, TorchAttentionBackend()).eval()
    load_safetensors(model, model_dir)
    kv_cache.allocate_kv_cache(model, 16, 8, config.num_key_value_heads, config.head_dim, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(25)
    seq_lens, query_lens = [13, 6], [13, 1]
    meta = paged_metadata(random_block_tables(seq_lens, 8, 16, g), seq_lens, query_lens, 8)
    meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(DEVICE) for f in dataclasses.fields(meta)
                                        if torch.is_tensor(getattr(meta, f.name))})
    input_ids = torch.randint(0, config.vocab_size, (sum(query_lens),), generator=g).to(DEVICE)
    positions = positions_of(seq_lens, query_lens).to(DEVICE)

    def logits(fused: bool) -> tuple[torch.Tensor, int]:
        calls = collections.Counter()
        with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
            patch.setattr(moe, "FUSED_ENABLED", fused)
            kernel = moe_kernels.fused_moe
            patch.setattr(moe_kernels, "fused_moe", lambda *a, **kw: calls.update(["moe"]) or kernel(*a, **kw))
            if DEVICE.type == "cpu":   # the block takes the fused path for CUDA tensors only
                patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
                from worker_svc.layers import fused_kernels
                patch.setattr(fused_kernels, "ENABLED", False)   # tests/test_fused_kernels.py covers those
            hidden = model(input_ids, positions, meta)
            return model.compute_logits(hidden, torch.arange(len(input_ids), device=DEVICE)).cpu(), calls["moe"]

    (reference, unfused_calls), (actual, fused_calls) = logits(False), logits(True)
    assert (unfused_calls, fused_calls) == (0, 2)   # layers 1 and 2 are sparse
    assert relative_error(actual, reference) <= 1e-5


@needs_cuda
def test_the_fused_path_replays_in_a_cuda_graph(kernels):
    """Routing, sorting and both GEMMs captured once, then replayed on new inputs: no host sync
    and no shape that depends on the routing."""
    moe_kernels, _ = kernels
    g = torch.Generator().manual_seed(26)
    w13, w2 = (w.cuda() for w in experts(16, 256, 128, torch.bfloat16, g))
    gate = (torch.randn(16, 256, generator=g) / 16).to(torch.bfloat16).cuda()
    x = torch.randn(8, 256, generator=g).to(torch.bfloat16).cuda()
    run = lambda: moe_kernels.fused_moe(x, x @ gate.T, w13, w2, 4, True)
    run()   # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in range(3):
        x.copy_(torch.randn(8, 256, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        weights, ids = moe.route(x @ gate.T, 4, True)
        assert relative_error(out, moe.moe_reference(x, w13, w2, weights, ids)) <= 2 ** -7


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
def test_qwen3_30b_a3b_shapes(kernels, num_tokens):
    """128 experts, top-8, hidden 2048, expert width 768, bf16, at decode batch sizes."""
    moe_kernels, _ = kernels
    g = torch.Generator().manual_seed(27)
    w13, w2 = (w.cuda() for w in experts(128, 2048, 768, torch.bfloat16, g))
    x = torch.randn(num_tokens, 2048, generator=g).to(torch.bfloat16).cuda()
    weights, ids = moe.route(torch.randn(num_tokens, 128, generator=g).to(torch.bfloat16).cuda(), 8, True)
    actual = moe_kernels.fused_experts(x, w13, w2, weights, ids)
    # Both sides round to bf16 at each GEMM's output and sum eight experts in a different order:
    # measured on an H200, 8.5e-3 at 256 tokens (a bf16 ulp is 2**-8 relative), so 2**-6 here.
    assert relative_error(actual, moe.moe_reference(x, w13, w2, weights, ids)) <= 2 ** -6
