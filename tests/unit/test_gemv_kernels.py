"""The few-row GEMV / split-K kernel (worker_svc/layers/gemv_kernels.py) against F.linear on
fresh random inputs. Without CUDA it runs under Triton's interpreter
(tests/support/triton_interpreter.py) on small shapes; the CUDA-graph and Qwen3-shaped tests
need a GPU.

Tolerances, as a fraction of the output's largest magnitude: float32 differs from a float64
product by the order of its sums (1e-5); bf16 output by one rounding (2^-7; the operands are
the same bf16 values, summed in float32). An FP8 weight is compared with its dequantized
values in float64: the same bounds.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.support.markers import requires_cuda
from tests.support.kernel_checks import every_e4m3_byte, relative_error
from tests.support.triton_interpreter import DEVICE, gpu_faithful
from worker_svc.layers.fp8 import dequantize_blocks, quantize_blocks

RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton", reason="triton is not installed")
    from worker_svc.layers import fused_kernels, gemv_kernels

    with gpu_faithful():
        yield gemv_kernels, fused_kernels


@pytest.fixture(scope="module")
def pdl_launch(kernels):
    from worker_svc.layers import pdl_launch

    return pdl_launch


def config(kernels, *args, **kwargs):
    return kernels[0].GemvConfig(*args, **kwargs)


def assert_graph_replays_as_plain(run, pdl, plain, *inputs: torch.Tensor) -> None:
    """run(pdl) captured in a CUDA graph (compiled outside it first), replayed three times on new
    random values in `inputs`: each time bit for bit run(plain), every output of it."""
    run(pdl)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(pdl)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for tensor in inputs:
            tensor.copy_(torch.randn(tensor.shape, generator=g, device="cuda"))
        graph.replay()
        expected = run(plain)
        pairs = zip(captured, expected) if isinstance(captured, tuple) else [(captured, expected)]
        assert all(torch.equal(a, b) for a, b in pairs), seed


# (block_m, block_n, block_k, split_k), rows, bias, dtype: CUDA-core FMAs for one and a few rows
# (split or not, partial K tiles, rows over two tiles), tensor cores for 16 rows and more.
CASES = [
    ((1, 8, 32, 1), 1, False, torch.float32),
    ((1, 16, 32, 2), 1, True, torch.bfloat16),
    ((4, 16, 64, 3), 3, True, torch.bfloat16),    # 96 columns: a partial last K tile
    ((2, 8, 128, 1), 3, False, torch.float32),    # two row tiles
    ((16, 16, 32, 2), 17, True, torch.bfloat16),  # tensor cores, two row tiles
]
# The same sums with one accumulator per row (row_acc, pipelined num_stages deep).
ROW_ACC_CASES = [
    ((1, 8, 32, 1), 1, False, torch.float32),
    ((1, 16, 32, 2), 1, True, torch.bfloat16),
    ((4, 16, 64, 3), 3, True, torch.bfloat16),    # a partial last K tile, a missing row
    ((2, 8, 128, 1), 3, False, torch.float32),    # two row tiles
]


@pytest.mark.parametrize("tiles,rows,bias,dtype,row_acc", [(*case, False) for case in CASES]
                         + [(*case, True) for case in ROW_ACC_CASES],
                         ids=lambda v: "m{}n{}k{}s{}".format(*v) if isinstance(v, tuple) else None)
def test_gemv_matches_f_linear_on_fresh_random_inputs(kernels, tiles, rows, bias, dtype, row_acc):
    """40 columns (a partial last N tile) by 96."""
    cfg = config(kernels, *tiles, row_acc=row_acc)
    if cfg.use_dot and dtype == torch.float32:
        pytest.skip("tensor-core tiles take 16-bit activations")
    g = torch.Generator().manual_seed(rows + tiles[0])
    x, w = torch.randn(rows, 96, generator=g).to(dtype), torch.randn(40, 96, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    actual = kernels[0].gemv(x.to(DEVICE), w.to(DEVICE), cfg, bias=None if b is None else b.to(DEVICE))
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert actual.dtype == dtype and actual.shape == (rows, 40)
    assert relative_error(actual, expected) <= RELATIVE[dtype]


@pytest.mark.parametrize("tiles,row_acc", [((4, 8, 64, 2), False), ((4, 8, 64, 2), True), ((16, 16, 32, 1), False),
                                           ((32, 16, 32, 2), False), ((64, 32, 32, 1), False)],
                         ids=["fma", "fma-rows", "dot", "dot32", "dot64"])
def test_gemv_applies_silu_mul_exactly_as_the_fused_activation_kernel(kernels, tiles, row_acc):
    """x = [gate | up]: the result equals the GEMV of fused_kernels.silu_and_mul's output bit
    for bit (the activation is rounded to bf16 where that kernel rounds it); on a GPU the 16- and
    32-row dot tiles take it through the layout fence (_load_act's SILU_FENCE), the 64-row one not."""
    gemv_kernels, fused_kernels = kernels
    g = torch.Generator().manual_seed(41)
    gate_up = (torch.randn(5, 2 * 96, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(24, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = config(kernels, *tiles, row_acc=row_acc)
    fused = gemv_kernels.gemv(gate_up, w, cfg, silu_mul=True)
    assert torch.equal(fused, gemv_kernels.gemv(fused_kernels.silu_and_mul(gate_up), w, cfg))


@pytest.mark.parametrize("tiles,block,dtype,row_acc", [
    ((2, 16, 64, 2), (32, 64), torch.float32, False),      # FMA, K tiles = scale blocks
    ((2, 16, 256, 1), (32, 64), torch.bfloat16, False),    # FMA, a K tile spans four scale blocks
    ((16, 16, 32, 3), (32, 64), torch.bfloat16, False),    # tensor cores, two K tiles per scale block
    ((16, 32, 128, 2), (128, 128), torch.bfloat16, False),  # tensor cores, split, the official blocks
    ((2, 32, 128, 1), (128, 128), torch.bfloat16, False),  # the official checkpoints' blocks
    ((2, 16, 64, 2), (32, 64), torch.float32, True),       # one accumulator per row: the same cases
    ((2, 16, 256, 1), (32, 64), torch.bfloat16, True),
    ((2, 32, 128, 1), (128, 128), torch.bfloat16, True),
])
def test_fp8_weight_only_gemv_matches_the_dequantized_reference(kernels, tiles, block, dtype, row_acc):
    cfg = config(kernels, *tiles, row_acc=row_acc)
    g = torch.Generator().manual_seed(42)
    weight, scale = quantize_blocks(torch.randn(80, 256, generator=g) * 0.05, block)   # a partial row block
    kernels[0].check_config(cfg, 80, 256, fp8_block=block, dtype=dtype)
    for rows in (1, 2):                                    # one row: a 16-row tile's first row, on tensor cores
        x = torch.randn(rows, 256, generator=g).to(dtype)
        actual = kernels[0].gemv(x.to(DEVICE), weight.to(DEVICE), cfg, weight_scale=scale.to(DEVICE), fp8_block=block)
        expected = F.linear(x.double(), dequantize_blocks(weight, scale, block, torch.float64))
        assert relative_error(actual, expected) <= RELATIVE[dtype]


@pytest.mark.parametrize("tiles,row_acc", [((1, 16, 64, 1), False), ((2, 16, 64, 3), False),
                                           ((1, 16, 64, 1), True), ((4, 32, 128, 2), True),
                                           ((16, 16, 32, 1), False), ((16, 32, 64, 2), False)])
def test_fp8_weights_taken_by_their_bits_give_the_converted_product_bit_for_bit(kernels, tiles, row_acc):
    """fp8_bits: each e4m3 weight as a float32 (CUDA cores) or bfloat16 (tensor cores) 2^-120 of
    its value, made by moving bits, with the activation scaled by 2^64 and the sums by 2^56: every
    e4m3 byte (zeros, subnormals, both signs, the largest) gives the converted loop's output
    exactly, split or not, silu_mul too."""
    gemv_kernels = kernels[0]
    g = torch.Generator().manual_seed(46)
    weight = every_e4m3_byte((48, 256), g)
    assert (weight.float() == 0).any() and (weight.float().abs() < 2 ** -6).any()   # zeros and subnormals
    scale = torch.rand(2, 4, generator=g) * 0.01 + 1e-4
    converted, moved = config(kernels, *tiles, row_acc=row_acc), config(kernels, *tiles, row_acc=row_acc, fp8_bits=True)
    gemv_kernels.check_config(moved, 48, 256, fp8_block=(32, 64))
    for rows, silu_mul in ((1, False), (3, False), (2, True)):
        x = torch.randn(rows, 512 if silu_mul else 256, generator=g).to(torch.bfloat16).to(DEVICE)
        w, ws = weight.to(DEVICE), scale.to(DEVICE)
        expected = gemv_kernels.gemv(x, w, converted, weight_scale=ws, fp8_block=(32, 64), silu_mul=silu_mul)
        actual = gemv_kernels.gemv(x, w, moved, weight_scale=ws, fp8_block=(32, 64), silu_mul=silu_mul)
        assert torch.equal(actual, expected), (rows, silu_mul)
    with pytest.raises(ValueError, match="moving bits"):   # bf16 weights, or tensor cores on other activations
        gemv_kernels.check_config(moved, 48, 256)
    with pytest.raises(ValueError, match="moving bits"):
        gemv_kernels.check_config(config(kernels, 16, 16, 64, fp8_bits=True), 48, 256, fp8_block=(32, 64),
                                  dtype=torch.float16)


def test_split_k_is_deterministic_and_leaves_its_counters_at_zero(kernels):
    gemv_kernels = kernels[0]
    g = torch.Generator().manual_seed(43)
    x = torch.randn(2, 512, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(16, 512, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = config(kernels, 2, 16, 128, split_k=4)
    first = gemv_kernels.gemv(x, w, cfg)
    assert torch.equal(first, gemv_kernels.gemv(x, w, cfg))
    assert not gemv_kernels.split_counters(x.device).any()
    assert relative_error(first, F.linear(x.cpu().double(), w.cpu().double())) <= 2 ** -7


def test_split_k_partials_summed_several_per_load_give_the_same_product(kernels):
    """split_chunk 4 over 6 splits: a full chunk and a partial one, deterministic, counters at zero."""
    gemv_kernels = kernels[0]
    g = torch.Generator().manual_seed(44)
    x = torch.randn(3, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(24, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = config(kernels, 4, 16, 64, split_k=6, split_chunk=4, row_acc=True)
    first = gemv_kernels.gemv(x, w, cfg)
    assert torch.equal(first, gemv_kernels.gemv(x, w, cfg))
    assert not gemv_kernels.split_counters(x.device).any()
    assert relative_error(first, F.linear(x.cpu().double(), w.cpu().double())) <= 2 ** -7


def test_configs_that_cannot_run_a_weight_are_refused(kernels):
    gemv_kernels = kernels[0]
    with pytest.raises(ValueError, match="16-bit"):
        gemv_kernels.check_config(config(kernels, 16, 16, 64), 64, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="row blocks"):   # an N tile across two scale blocks
        gemv_kernels.check_config(config(kernels, 1, 64, 64), 128, 128, fp8_block=(32, 32))
    with pytest.raises(ValueError, match="column blocks"):   # a tensor-core K tile across two
        gemv_kernels.check_config(config(kernels, 16, 16, 64), 128, 128, fp8_block=(32, 32))
    gemv_kernels.check_config(config(kernels, 1, 16, 256), 128, 128, fp8_block=(32, 32))   # FMA: any K tile
    with pytest.raises(ValueError, match="per row"):   # 8 rows, or tensor cores, with one accumulator per row
        gemv_kernels.check_config(config(kernels, 8, 16, 64, row_acc=True), 64, 64)
    with pytest.raises(ValueError, match="power of two"):
        gemv_kernels.check_config(config(kernels, 1, 16, 64, split_k=4, split_chunk=3), 64, 256)
    with pytest.raises(ValueError, match="16-byte"):   # a bulk L2 prefetch moves whole 16-byte units
        gemv_kernels.check_config(config(kernels, 1, 16, 64, pdl=True, prefetch=2), 64, 72)


def test_no_rows_give_an_empty_output(kernels):
    w = torch.ones(8, 32, device=DEVICE)
    assert kernels[0].gemv(torch.empty(0, 32, device=DEVICE), w, config(kernels, 1, 8, 32)).shape == (0, 8)


@requires_cuda
def test_programmatic_dependent_launch_replays_in_graphs_on_hopper(kernels, pdl_launch):
    """sm90+ with CUDA 12.3+: chained PDL GEMVs replayed from a graph equal plain launches
    (otherwise the start-up candidates quietly go without PDL)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm90")
    assert pdl_launch.pdl_in_graphs(torch.device("cuda", torch.cuda.current_device()))


@requires_cuda
@pytest.mark.parametrize("pdl, late", [(False, False), (True, False), (True, True)], ids=["plain", "pdl", "late"])
@pytest.mark.parametrize("tiles", [(1, 8, 512, 4), (16, 32, 128, 2)], ids=["fma", "dot"])
def test_gemv_replays_in_a_cuda_graph(kernels, tiles, pdl, late):
    """Split-K counters (and programmatic dependent launch, its trigger at the start or after the
    loop) inside a captured graph."""
    gemv_kernels = kernels[0]
    g = torch.Generator(device="cuda").manual_seed(44)
    w = torch.randn(1024, 2048, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(tiles[0], 2048, generator=g, device="cuda").to(torch.bfloat16)
    cfg = gemv_kernels.GemvConfig(*tiles, pdl=pdl, late_trigger=late)
    gemv_kernels.gemv(x, w, cfg)   # compiles and allocates the counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_kernels.gemv(x, w, cfg)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        assert torch.equal(out, gemv_kernels.gemv(x, w, cfg))
        assert relative_error(out, F.linear(x.double(), w.double())) <= 2 ** -7


def attention_and_swiglu_chain(rows: int, device: torch.device):
    """(inputs, run): Triton decode attention (Qwen3-0.6B's heads) into an o projection's GEMV, and
    SwiGLU into a down projection's GEMV; run(cfg) gives both outputs with the GEMVs launched as cfg."""
    from worker_svc.layers import fused_kernels
    from worker_svc.layers.attention import triton_kernels
    from worker_svc.layers.attention.selection import AttentionShape, synthetic_step
    from worker_svc.layers.gemv_kernels import gemv

    shape = AttentionShape(16, 8, 128, torch.bfloat16, 16, max_num_seqs=64, max_num_batched_tokens=1024,
                           max_model_len=4096)
    q, _, _, k_cache, v_cache, meta = synthetic_step([(300, 1)] * rows, shape, device, pool_blocks=64, seed=rows)
    g = torch.Generator().manual_seed(47)
    w_o = (torch.randn(1024, 16 * 128, generator=g) * 0.05).to(torch.bfloat16).to(device)
    w_down = (torch.randn(1024, 3072, generator=g) * 0.05).to(torch.bfloat16).to(device)
    gate_up = torch.randn(rows, 2 * 3072, generator=g).to(torch.bfloat16).to(device)

    def run(cfg):
        attended = triton_kernels.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                                  meta.block_tables, 128 ** -0.5, pure_decode=True)
        return gemv(attended.reshape(rows, -1), w_o, cfg), gemv(fused_kernels.silu_and_mul(gate_up), w_down, cfg)

    return (q, gate_up), run


def test_the_attention_and_swiglu_chain_runs_here(kernels):
    """attention_and_swiglu_chain's shapes, on whatever device the tests run (the GPU test below
    replays it with PDL)."""
    (q, _), run = attention_and_swiglu_chain(2, torch.device(DEVICE))
    o, down = run(config(kernels, 2, 8, 256))
    assert o.shape == down.shape == (2, 1024) and torch.isfinite(o.float()).all() and torch.isfinite(down.float()).all()


@requires_cuda
@pytest.mark.parametrize("rows", [1, 8])
def test_pdl_gemvs_after_triggering_attention_and_swiglu_read_their_outputs(kernels, pdl_launch, rows):
    """Decode attention and SwiGLU let the projection after them launch at their start (as the
    norms do); GEMVs launched with PDL read their outputs only after their waits: in a graph
    replayed on new inputs, the chain equals the same kernels launched plainly, bit for bit."""
    device = torch.device("cuda", torch.cuda.current_device())
    if not pdl_launch.pdl_in_graphs(device):
        pytest.skip("programmatic dependent launch does not replay in graphs here")
    (q, gate_up), run = attention_and_swiglu_chain(rows, device)
    block_m = 1 << (rows - 1).bit_length()
    pdl, plain = (config(kernels, block_m, 8, 512 // block_m, pdl=on) for on in (True, False))
    assert_graph_replays_as_plain(lambda cfg: tuple(run(cfg)), pdl, plain, q, gate_up)


@requires_cuda
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_a_pdl_gemv_after_a_triggering_norm_reads_the_norms_output(kernels, pdl_launch, rows):
    """The RMSNorm lets the GEMV after it launch at its start (pdl_launch.pdl_triggers); the
    GEMV, launched with PDL, reads the norm's output only after its wait: in a graph replayed on
    new inputs, norm + GEMV equal the same pair launched plainly, bit for bit."""
    gemv_kernels = kernels[0]
    from worker_svc.layers import fused_kernels

    device = torch.device("cuda", torch.cuda.current_device())
    if not pdl_launch.pdl_in_graphs(device):
        pytest.skip("programmatic dependent launch does not replay in graphs here")
    assert pdl_launch.pdl_triggers(device)
    g = torch.Generator(device="cuda").manual_seed(46)
    w = torch.randn(4096, 1024, generator=g, device="cuda").to(torch.bfloat16)
    norm_weight = torch.rand(1024, generator=g, device="cuda").to(torch.bfloat16) + 0.5
    x = torch.randn(rows, 1024, generator=g, device="cuda").to(torch.bfloat16)
    block_m = min(16, 1 << (rows - 1).bit_length())   # FMA tiles up to 4 rows, tensor cores past them
    pdl, plain = (gemv_kernels.GemvConfig(block_m, 8 if block_m < 16 else 32, 512 // block_m if block_m < 16 else 128,
                                          pdl=on) for on in (True, False))

    def pair(cfg):
        return gemv_kernels.gemv(fused_kernels.rms_norm(x, norm_weight, 1e-6), w, cfg)

    assert_graph_replays_as_plain(pair, pdl, plain, x)


def test_the_chain_kernels_launch_plainly_without_a_hopper_or_with_the_chain_off(kernels, pdl_launch, monkeypatch):
    """pdl_chain_args: no trigger, wait or PDL launch off a Hopper (here: the CPU), and no wait or PDL
    launch with WORKER_PDL_CHAIN=0 even where the triggers stay."""
    assert pdl_launch.pdl_chain_args(torch.device("cpu")) == {"TRIGGER": False, "WAIT": False, "launch_pdl": False}
    monkeypatch.setattr(pdl_launch, "pdl_triggers", lambda device: True)
    monkeypatch.setattr(pdl_launch, "pdl_in_graphs", lambda device: True)
    assert pdl_launch.pdl_chain_args(torch.device("cpu"))["WAIT"]
    monkeypatch.setattr(pdl_launch, "PDL_CHAIN", False)
    assert pdl_launch.pdl_chain_args(torch.device("cpu")) == {"TRIGGER": True, "WAIT": False, "launch_pdl": False}


@requires_cuda
@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("mode", ["chain", "whole-slice", "raw-qkv"])
def test_a_decode_layer_as_one_pdl_chain_replays_as_plain_launches(kernels, pdl_launch, rows, mode, monkeypatch):
    """Every kernel of a decode layer launched with PDL (pdl_launch.pdl_waits: the norms, the q/k
    norm + RoPE + store, attention, SwiGLU, as the GEMVs are), each waiting for the one before it:
    captured in a graph and replayed on new inputs, the layer equals its kernels launched plainly
    (WORKER_PDL_CHAIN=0, GEMVs without PDL), bit for bit, its KV cache's new rows included. Also with
    GEMVs that read their whole weight slice before the wait (whole_slice_configs), and with attention
    taking the raw qkv projection (attention/decode_qk.py: the q/k norm, RoPE and store in its launch)."""
    gemv_kernels, fused_kernels = kernels
    from worker_svc.layers.attention import qkv_store, triton_kernels
    from worker_svc.layers.attention.decode_qk import DecodeQK
    from worker_svc.layers.attention.selection import AttentionShape, synthetic_step
    from worker_svc.layers.linear_candidates import whole_slice_configs

    device = torch.device("cuda", torch.cuda.current_device())
    if not (pdl_launch.pdl_triggers(device) and pdl_launch.pdl_in_graphs(device)):
        pytest.skip("programmatic dependent launch does not replay in graphs here")
    if mode == "whole-slice" and not whole_slice_configs(rows, 1024, pdl=True):
        pytest.skip("no whole-slice GEMVs at this many rows")
    shape = AttentionShape(16, 8, 128, torch.bfloat16, 16, max_num_seqs=64, max_num_batched_tokens=1024,
                           max_model_len=4096)
    # Each request's blocks its own, as the block manager hands them out for a decode step (blocks are shared
    # only once full: test_scheduler_properties): with raw-qkv, attention stores each request's new key and
    # reads the others' contexts in one launch, so a slot shared between requests (a random pool's) would be
    # read before or after its store as the programs happen to run.
    _, _, _, k_cache, v_cache, meta = synthetic_step([(300, 1)] * rows, shape, device, seed=rows)
    g = torch.Generator().manual_seed(48)

    def weight(*dims, scale=0.05):
        return (torch.randn(*dims, generator=g) * scale).to(torch.bfloat16).to(device)

    w_qkv, w_o, w_gate_up, w_down = weight(4096, 1024), weight(1024, 2048), weight(6144, 1024), weight(1024, 3072)
    norms = [(torch.rand(size, generator=g) + 0.5).to(torch.bfloat16).to(device) for size in (1024, 1024, 128, 128)]
    x, residual = weight(rows, 1024, scale=1.0), weight(rows, 1024, scale=1.0)
    cos_sin = torch.randn(rows, 128, generator=g).to(device)
    new_slots = meta.slot_mapping.long()

    block_m = 1 << (rows - 1).bit_length()

    def cfg(width, pdl):
        if mode == "whole-slice":
            return dataclasses.replace(whole_slice_configs(rows, width, pdl=True)[0], pdl=pdl)
        return config(kernels, block_m, 16 if block_m >= 16 else 8, max(32, 512 // block_m), pdl=pdl)

    def layer(pdl):
        monkeypatch.setattr(pdl_launch, "PDL_CHAIN", pdl)
        assert pdl_launch.pdl_waits(device) == pdl
        h, res = fused_kernels.rms_norm(x, norms[0], 1e-6, residual)
        qkv = gemv_kernels.gemv(h, w_qkv, cfg(1024, pdl))
        qk = None
        if mode == "raw-qkv":
            q = qkv[:, :16 * 128].view(rows, 16, 128)
            qk = DecodeQK(qkv, norms[2], norms[3], 1e-6, 1e-6, cos_sin, meta.slot_mapping)
        else:
            q = qkv_store.qk_norm_rope_store(qkv, norms[2], norms[3], 1e-6, 1e-6, cos_sin, 16, 8, k_cache, v_cache,
                                             meta.slot_mapping)
        attended = triton_kernels.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                                  meta.block_tables, 128 ** -0.5, pure_decode=True, qk=qk)
        h, res = fused_kernels.rms_norm(gemv_kernels.gemv(attended.reshape(rows, -1), w_o, cfg(2048, pdl)), norms[1],
                                        1e-6, res)
        gate_up = gemv_kernels.gemv(h, w_gate_up, cfg(1024, pdl))
        down = gemv_kernels.gemv(fused_kernels.silu_and_mul(gate_up), w_down, cfg(3072, pdl))
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        return down, res, flat_k[new_slots].clone()

    assert_graph_replays_as_plain(layer, True, False, x, residual)


@pytest.mark.parametrize("tiles,rows,bias,dtype", CASES, ids=lambda v: "m{}n{}k{}s{}".format(*v)
                         if isinstance(v, tuple) else None)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_a_folded_norm_gives_the_norm_kernel_then_the_gemv(kernels, tiles, rows, bias, dtype, residual, fp8):
    """The RMSNorm folded into the GEMV (each program's rows' inverse RMS over the whole of K; the
    column-0 tiles storing x + residual over their K slices): the product of fused_kernels.rms_norm's
    output, bit for bit on the CPU (the GPU's sums of squares may come in another order: one
    rounding), and the new residual exactly; bf16 and FP8 weights, split K and not, both loops."""
    gemv_kernels, fused_kernels = kernels
    if fp8 and dtype == torch.float32:
        pytest.skip("FP8 weights take 16-bit activations here")
    g = torch.Generator().manual_seed(48 + rows)
    width = 96
    x = torch.randn(rows, width, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(rows, width, generator=g).to(dtype).to(DEVICE) if residual else None
    norm_weight = (torch.rand(width, generator=g) + 0.5).to(dtype).to(DEVICE)
    b = torch.randn(40, generator=g).to(dtype).to(DEVICE) if bias else None
    w = (torch.randn(40, width, generator=g) / width ** 0.5).to(dtype).to(DEVICE)
    kwargs = {}
    if fp8:
        w, scale = quantize_blocks(w.float().cpu(), (16, 32))
        w, kwargs = w.to(DEVICE), dict(weight_scale=scale.to(DEVICE), fp8_block=(16, 32))
    cfg = config(kernels, *tiles[:3], split_k=tiles[3])
    if fp8:
        gemv_kernels.check_config(cfg, 40, width, fp8_block=(16, 32), dtype=dtype)
    normed = fused_kernels.rms_norm(x, norm_weight, 1e-6, res)
    expected = gemv_kernels.gemv(normed[0] if residual else normed, w, cfg, bias=b, **kwargs)
    out_residual = torch.empty_like(x) if residual else None
    got = gemv_kernels.gemv(x, w, cfg, bias=b, norm=gemv_kernels.FoldedNorm(norm_weight, 1e-6, res, out_residual),
                            **kwargs)
    if residual:
        got, total = got
        assert total is not None and total.data_ptr() == out_residual.data_ptr()
        assert torch.equal(total, normed[1])
    if DEVICE.type == "cpu":
        assert torch.equal(got, expected)
    else:
        assert relative_error(got, expected) <= RELATIVE[dtype]


@pytest.mark.parametrize("rows,width", [(1, 96), (1, 200), (1, 64), (16, 200), (24, 96)])
def test_whole_slice_launches_read_one_k_tile_a_program_and_match_f_linear(kernels, rows, width):
    """linear_candidates.whole_slice_configs: every launch it gives holds one K tile a program (its whole
    slice of the weight, loaded before the PDL wait: gemv_kernels.whole_slice; FMA tiles at one row,
    tensor-core ones with early_dot from 16 rows), and each computes the plain product, SwiGLU's and the
    folded norm's as the other loops do; none without PDL, between WHOLE_SLICE_MAX_ROWS and 16 rows, or
    past GEMV_MAX_ROWS, and a two-tile, late-triggering, row-accumulator or plain tensor-core launch is
    not one."""
    from worker_svc.layers import linear_candidates as lc

    gemv_kernels, fused_kernels = kernels
    configs = lc.whole_slice_configs(rows, width, pdl=True)
    assert configs and all(gemv_kernels.whole_slice(c, width) for c in configs)
    assert lc.whole_slice_configs(rows, width, pdl=False) == []
    assert lc.whole_slice_configs(lc.WHOLE_SLICE_MAX_ROWS + 1, width, pdl=True) == []
    assert lc.whole_slice_configs(lc.GEMV_MAX_ROWS + 1, width, pdl=True) == []
    assert all(c.early_dot == c.use_dot == (rows >= 16) for c in configs)
    assert not gemv_kernels.whole_slice(config(kernels, 1, 8, 32, pdl=True), width)   # several K tiles
    assert not gemv_kernels.whole_slice(config(kernels, 1, 8, 256), width)   # no PDL wait
    for other in (dict(late_trigger=True), dict(row_acc=True)):
        assert not gemv_kernels.whole_slice(config(kernels, 1, 8, 256, pdl=True, **other), width)
    assert not gemv_kernels.whole_slice(config(kernels, 16, 16, 256, pdl=True), width)
    g = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, 2 * width, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(40, width, generator=g) / width ** 0.5).to(torch.bfloat16).to(DEVICE)
    norm_weight = (torch.rand(width, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(rows, width, generator=g).to(torch.bfloat16).to(DEVICE)
    for cfg in configs:
        first = x[:, :width].contiguous()
        assert relative_error(gemv_kernels.gemv(first, w, cfg), F.linear(first.double(), w.double())) <= 2 ** -7
        if cfg.early_dot:   # the first tile's product outside the loop: the same sums in the same order,
            # also where the loop then runs the program's further tiles (unsplit)
            for variant in (cfg, dataclasses.replace(cfg, split_k=1)):
                plain = dataclasses.replace(variant, early_dot=False)
                assert torch.equal(gemv_kernels.gemv(x, w, variant, silu_mul=True),
                                   gemv_kernels.gemv(x, w, plain, silu_mul=True))
        activated = fused_kernels.silu_and_mul(x)
        assert relative_error(gemv_kernels.gemv(x, w, cfg, silu_mul=True),
                              F.linear(activated.double(), w.double())) <= 2 ** -7
        normed, total = fused_kernels.rms_norm(first, norm_weight, 1e-6, res)
        got, got_total = gemv_kernels.gemv(first, w, cfg, norm=gemv_kernels.FoldedNorm(norm_weight, 1e-6, res))
        assert torch.equal(got_total, total)
        assert relative_error(got, F.linear(normed.double(), w.double())) <= 2 ** -7


def test_a_folded_norm_is_refused_where_it_cannot_run(kernels):
    gemv_kernels, _ = kernels
    x, w = torch.zeros(1, 64, device=DEVICE), torch.zeros(8, 64, device=DEVICE)
    norm = gemv_kernels.FoldedNorm(torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="folded norm"):
        gemv_kernels.gemv(x, w, config(kernels, 1, 8, 32, row_acc=True), norm=norm)
    with pytest.raises(AssertionError, match="folded norm"):
        gemv_kernels.gemv(torch.zeros(1, 128, device=DEVICE), w, config(kernels, 1, 8, 32), norm=norm, silu_mul=True)


@requires_cuda
@pytest.mark.parametrize("rows", [1, 16])
def test_a_chain_of_gemvs_triggering_after_their_loops_reads_each_others_outputs(kernels, pdl_launch, rows):
    """Three PDL GEMVs in a graph, each letting the next launch only once its loop is done (its
    stores and split-K sums still to come): each reads the one before it's whole output, bit for
    bit against the chain launched plainly, over replays on new inputs."""
    gemv_kernels = kernels[0]
    device = torch.device("cuda", torch.cuda.current_device())
    if not pdl_launch.pdl_in_graphs(device):
        pytest.skip("programmatic dependent launch does not replay in CUDA graphs here")
    g = torch.Generator(device="cuda").manual_seed(47)
    weights = [(torch.randn(cols, width, generator=g, device="cuda") / width ** 0.5).to(torch.bfloat16)
               for cols, width in ((2048, 1024), (1024, 2048), (512, 1024))]
    x = torch.randn(rows, 1024, generator=g, device="cuda").to(torch.bfloat16)
    tiles = (1, 8, 512) if rows == 1 else (16, 32, 128)
    late, plain = (gemv_kernels.GemvConfig(*tiles, split_k=split, pdl=on, late_trigger=on)
                   for split, on in ((4, True), (4, False)))

    def chain(cfg):
        out = x
        for w in weights:
            out = gemv_kernels.gemv(out, w, cfg)
        return out

    assert_graph_replays_as_plain(chain, late, plain, x)
    assert not gemv_kernels.split_counters(device).any()


@requires_cuda
@pytest.mark.parametrize("rows", [1, 4])
def test_a_pdl_gemv_folding_the_norm_reads_the_gemv_before_it(kernels, pdl_launch, rows):
    """o projection -> (residual add + RMSNorm folded into) gate_up, both PDL (the second waits
    before its sums of squares), in a graph replayed on new inputs: bit for bit the same chain
    launched plainly, the new residual too."""
    gemv_kernels = kernels[0]
    device = torch.device("cuda", torch.cuda.current_device())
    if not pdl_launch.pdl_in_graphs(device):
        pytest.skip("programmatic dependent launch does not replay in CUDA graphs here")
    g = torch.Generator(device="cuda").manual_seed(49)
    w_o = (torch.randn(1024, 2048, generator=g, device="cuda") / 45).to(torch.bfloat16)
    w_up = (torch.randn(6144, 1024, generator=g, device="cuda") / 32).to(torch.bfloat16)
    norm_weight = (torch.rand(1024, generator=g, device="cuda") + 0.5).to(torch.bfloat16)
    attn = torch.randn(rows, 2048, generator=g, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, 1024, generator=g, device="cuda").to(torch.bfloat16)
    block_m = 1 << (rows - 1).bit_length()
    pdl, plain = (gemv_kernels.GemvConfig(block_m, 8, 512 // block_m, split_k=2, pdl=on) for on in (True, False))

    def chain(cfg):
        hidden = gemv_kernels.gemv(attn, w_o, cfg)
        return gemv_kernels.gemv(hidden, w_up, cfg, norm=gemv_kernels.FoldedNorm(norm_weight, 1e-6, residual))

    assert_graph_replays_as_plain(chain, pdl, plain, attn)


@requires_cuda
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_qwen3_8b_shapes_bf16_and_fp8(kernels, rows):
    """Qwen3-8B's projections, every start-up GEMV candidate, against F.linear in float64."""
    from worker_svc.layers.linear_candidates import gemv_configs

    gemv_kernels = kernels[0]
    g = torch.Generator(device="cuda").manual_seed(45)
    for cols, width in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]:
        w = (torch.randn(cols, width, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        w8, scale = quantize_blocks(w, (128, 128))
        x = torch.randn(rows, width, generator=g, device="cuda").to(torch.bfloat16)
        expected = F.linear(x.double(), w.double())
        expected8 = F.linear(x.double(), dequantize_blocks(w8, scale, (128, 128), torch.float64))
        for cfg in gemv_configs(rows, cols, width, torch.cuda.get_device_properties(0).multi_processor_count, fp8=True):
            assert relative_error(gemv_kernels.gemv(x, w, cfg), expected) <= 2 ** -7, cfg
            try:
                gemv_kernels.check_config(cfg, cols, width, fp8_block=(128, 128))
            except ValueError:
                continue
            actual = gemv_kernels.gemv(x, w8, cfg, weight_scale=scale, fp8_block=(128, 128))
            assert relative_error(actual, expected8) <= 2 ** -7, cfg
