"""The start-up choice of linear methods (worker_svc/layers/linear_selection.py) and the plans
it installs (linear_methods.LinearPlan), with injected timings: which method wins each row
count, which candidates are refused, and that a model whose layers run their plans computes
what it computes without them. Without CUDA the Triton methods run under Triton's interpreter
on a tiny model; the last test measures for real on a GPU.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

from tests.support.markers import requires_cuda
from tests.support.triton_interpreter import DEVICE, gpu_faithful
from tests.support.worker_batches import paged_metadata, positions_of, random_block_tables, tiny_qwen3_with_cache
from worker_svc import kv_cache
from worker_svc.layers.attention import TorchAttentionBackend
from worker_svc.layers.fp8 import quantize_blocks
from worker_svc.model_config import load_model_config
from worker_svc.models.qwen3 import Qwen3ForCausalLM


@pytest.fixture(scope="module")
def selection():
    pytest.importorskip("triton", reason="triton is not installed")
    from worker_svc.layers import linear_methods, linear_selection

    # the injected timings decide alone (the whole-slice preference has its own test)
    with gpu_faithful(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(linear_selection, "WHOLE_SLICE_ROWS", 0)
        yield linear_selection, linear_methods


@pytest.fixture(scope="module")
def lc(selection):
    """linear_candidates: what the selection tries, and the tile tables behind it."""
    from worker_svc.layers import linear_candidates

    return linear_candidates


def timings(table: dict[str, float]):
    """A measure that reads each method's time from `table` by the start of its name."""
    def measure(method, runners, x):
        return next(t for prefix, t in table.items() if str(method).startswith(prefix))
    return measure


def zeros_method(methods):
    """A method whose product is all zeros: its check against the product refuses it."""
    @dataclasses.dataclass(frozen=True)
    class Zeros(methods.Method):
        name = "zeros"

        def bind(self, operands, dtype):
            return lambda x, bias: torch.zeros(x.shape[0], operands.weight.shape[0], dtype=x.dtype, device=x.device)
    return Zeros()


def bf16_operands(methods, cols=48, width=64, seed=51):
    g = torch.Generator().manual_seed(seed)
    return methods.LinearOperands((torch.randn(cols, width, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE))


def test_the_fastest_method_wins_each_row_count(selection, lc):
    linear_selection, methods = selection
    gemv = methods.Gemv(lc.GemvConfig(2, 16, 64))
    operands = bf16_operands(methods)
    # The GEMV wins at 1 row, cuBLAS at 2; at 4 and past it only cuBLAS is a candidate (unmeasured).
    calls = collections.Counter()

    def measure(method, runners, x):
        calls[x.shape[0]] += 1
        return 0.5 if x.shape[0] == 1 and str(method).startswith("gemv") else 1.0

    def candidate_methods(op, rows, *args):
        return [methods.Cublas(), gemv] if rows <= 2 else [methods.Cublas()]

    choice = linear_selection.choose_methods("proj", [operands], torch.bfloat16, DEVICE, max_rows=4, sms=4,
                                             measure=measure, candidate_methods=candidate_methods)
    assert list(choice.chosen) == [1, 2, 4]
    assert [str(m) for m in choice.chosen.values()] == [str(gemv), "cublas", "cublas"]
    assert str(choice.beyond) == "cublas" and calls == {1: 2, 2: 2}
    plan = linear_selection.bind_plan(choice, operands, torch.bfloat16)
    for rows in (1, 2, 3, 4, 9):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).to(DEVICE)
        expected = F.linear(x.double(), operands.weight.double())
        assert ((plan(x, None).double() - expected).abs().max() / expected.abs().max()).item() <= 2 ** -7
    assert plan.runner_for(1) is not plan.runner_for(2) is plan.runner_for(3) is plan.runner_for(9)
    assert choice.summary().startswith("1: gemv(m2 n16 k64") and choice.summary().endswith("4: cublas; >4: cublas")
    # the full table: every candidate at each measured row count, quickest first (4 rows: nothing measured)
    assert choice.table() == f"1: {gemv} 0.5000, cublas 1.0000; 2: cublas 1.0000, {gemv} 1.0000"


def test_a_method_that_disagrees_with_the_product_is_never_chosen(selection):
    linear_selection, methods = selection
    choice = linear_selection.choose_methods(
        "proj", [bf16_operands(methods)], torch.bfloat16, DEVICE, max_rows=2, sms=4,
        measure=timings({"zeros": 0.1, "cublas": 1.0}),
        candidate_methods=lambda *a: [zeros_method(methods), methods.Cublas()])
    assert {str(m) for m in choice.chosen.values()} == {"cublas"}
    assert "relative error" in choice.rejected["zeros"]


@pytest.mark.parametrize("speedup,expected", [(1.05, "fp8-gemm"), (1.25, "bf16-dequantized")])
def test_fp8_weights_keep_a_bf16_copy_only_where_it_is_clearly_faster(selection, speedup, expected):
    linear_selection, methods = selection
    g = torch.Generator().manual_seed(52)
    values, scale = quantize_blocks(torch.randn(64, 128, generator=g) * 0.05, (32, 64))
    operands = methods.LinearOperands(values.to(DEVICE), scale.to(DEVICE), (32, 64))
    fp8_gemm = methods.Fp8Gemm.of(dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=2))
    choice = linear_selection.choose_methods(
        "proj", [operands], torch.bfloat16, DEVICE, max_rows=1, sms=4,
        measure=timings({"fp8-gemm": 1.0, "bf16": 1.0 / speedup}),
        candidate_methods=lambda *a: [fp8_gemm, methods.Dequantized()])
    assert str(choice.chosen[1]).startswith(expected) and str(choice.beyond).startswith(expected)


def test_auto_split_fills_the_device_with_at_least_two_k_tiles_per_split(selection, lc):
    linear_selection, _ = selection
    config = lc.GemvConfig(1, 8, 512)
    assert lc.auto_split(1024, 2048, 1, config, sms=132) == 2       # 128 programs, 4 K tiles
    assert lc.auto_split(24576, 4096, 1, config, sms=132) == 1      # 3072 programs already
    assert lc.auto_split(6144, 4096, 1, config, sms=132) == 2       # 768 programs: 1536
    assert lc.auto_split(1024, 12288, 1, config, sms=132) == 9      # 24 K tiles: 1152 programs
    for rows in (1, 3, 8, 16, 64):
        for cfg in lc.gemv_configs(rows, 1024, 3072, sms=132):
            assert cfg.block_m >= rows or cfg.block_m == 16 or rows > 16
            assert cfg.split_k == 1 or 3072 // cfg.block_k // cfg.split_k >= 2


def test_start_up_tries_both_fma_loops_on_a_few_rows_and_every_candidate_can_run(selection, lc):
    """One accumulator per row beside the previous loop up to 4 rows, never past them; the bench
    sweep holds every start-up candidate and names each setting's loop."""
    linear_selection, _ = selection
    from bench.stages.linear_sweep import family_bests, gemv_family, sweep_gemv_configs
    from worker_svc.layers.gemv_kernels import check_config

    for rows in (1, 2, 4, 8, 16):
        configs = lc.gemv_configs(rows, 4096, 4096, sms=132)
        looped = {(c.row_acc, c.use_dot) for c in configs}
        assert ((True, False) in looped) == (rows <= 4) and ((False, False) in looped) == (rows < 16)
        for cfg in configs:
            check_config(cfg, 4096, 4096, fp8_block=(128, 128))
        fp8_configs = lc.gemv_configs(rows, 4096, 4096, sms=132, fp8=True)
        # One row tries tensor cores for FP8 weights only (their dot converts to 16 bits, not 32).
        assert any(c.use_dot for c in configs) == (rows > 1) and any(c.use_dot for c in fp8_configs)
        swept = {str(c) for c in sweep_gemv_configs(rows, 4096, 4096, 132, fp8=True, pdl=True)}
        assert {str(c) for c in configs + fp8_configs} <= swept
    names = {gemv_family(f"gemv({c})") for c in sweep_gemv_configs(1, 4096, 4096, 132, fp8=True, pdl=True)}
    assert names == {"fma", "rows", "pf", "chunk", "bits", "dot"}
    assert gemv_family("gemv(m16 n32 k128 split1 w4 s4 pdl)") == "dot" and gemv_family("cublas") is None
    # FP8 weights on tensor cores: each tile also with the weights taken by their bits (not the FMA loops,
    # nor bf16 weights); the sweep has both loops' bits settings
    one_row_fp8 = lc.gemv_configs(1, 4096, 4096, sms=132, fp8=True)
    assert {str(c) for c in one_row_fp8 if c.fp8_bits} == {f"{c} bits" for c in one_row_fp8 if c.use_dot and not c.fp8_bits}
    assert not any(c.fp8_bits for c in lc.gemv_configs(4, 4096, 4096, sms=132))
    assert any(c.fp8_bits and not c.use_dot for c in sweep_gemv_configs(1, 4096, 4096, 132, fp8=True, pdl=True))
    record = {"projection": "p", "rows": 1, "bf16_times": {"cublas": 1.0, "gemv(m1 n8 k512 split1 w4 s1 pdl)": 3.0,
                                                           "gemv(m1 n4 k512 split1 w4 s1 pdl)": 2.0,
                                                           "gemv(m1 n8 k512 split2 w4 s3 pdl rows pf2)": 1.5,
                                                           "gemv(m1 n8 k512 split1 w4 s3 pdl rows)": 1.8}}
    assert family_bests([record]) == [{"projection": "p", "rows": 1, "weights": "bf16",
                                       "best": {"fma": 2.0, "pf": 1.5, "rows": 1.8}}]


@pytest.mark.parametrize("fold", [False, True], ids=["gemv", "norm-folded"])
def test_a_model_running_its_plans_matches_the_model_without_them(selection, tiny_model_dir, fold, lc):
    """Every projection kind of a tiny Qwen3 (the down projection with SwiGLU fused, the LM head)
    planned to run the GEMV for decode-sized steps and cuBLAS for a prompt; with `fold`, qkv and
    gate_up (fed by the RMSNorms) fold the norm before them in; the float32 logits match those of
    the same model without plans up to the order of sums."""
    linear_selection, methods = selection
    dtype = torch.float32
    config = load_model_config(tiny_model_dir)
    model = tiny_qwen3_with_cache(tiny_model_dir, dtype, DEVICE)
    gemv = methods.Gemv(lc.GemvConfig(2, 64, 64, split_k=2))
    folded = methods.Gemv(lc.GemvConfig(2, 64, 64, split_k=2), fold_norm=True)
    kinds = linear_selection.linear_kinds(model)
    assert sorted(label.split()[0] for label, _ in kinds.values()) == ["down_proj", "gate_up_proj", "lm_head",
                                                                       "o_proj", "qkv_proj"]
    for label, layers in kinds.values():
        operands = [layer.operands() for layer in layers]
        choice = linear_selection.choose_methods(
            label, operands, dtype, DEVICE, max_rows=2, sms=4,
            measure=timings({str(folded): 0.3, "gemv": 0.5, "cublas": 1.0}),
            candidate_methods=lambda op, *a: [m for m in [methods.Cublas(), gemv] + [folded] * fold
                                              if m.supports(op, dtype)])
        for layer, op in zip(layers, operands, strict=True):
            layer.plan = linear_selection.bind_plan(choice, op, dtype)
    g = torch.Generator().manual_seed(53)
    seq_lens, query_lens = [9, 5], [1, 1]   # two decodes: 2 rows, the GEMV's
    meta = paged_metadata(random_block_tables(seq_lens, 8, 32, g), seq_lens, query_lens, 8)
    meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(DEVICE) for f in dataclasses.fields(meta)
                                        if torch.is_tensor(getattr(meta, f.name))})
    input_ids = torch.randint(0, config.vocab_size, (2,), generator=g).to(DEVICE)
    positions = positions_of(seq_lens, query_lens).to(DEVICE)

    def logits(planned: bool):
        gemv_calls = collections.Counter()
        with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
            if not planned:
                for _, layers in kinds.values():
                    for layer in layers:
                        patch.setattr(layer, "plan", None)
            original = methods.gemv
            patch.setattr(methods, "gemv", lambda *a, **kw: gemv_calls.update(
                ["norm" if kw.get("norm") is not None else kw["silu_mul"]]) or original(*a, **kw))
            if DEVICE.type == "cpu":   # the layers' fused kernels run on "CUDA" tensors only
                patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            hidden = model(input_ids, positions, meta)
            result = model.compute_logits(hidden, torch.arange(2, device=DEVICE)).float().cpu()
        return result, gemv_calls

    (expected, unplanned_calls), (actual, planned_calls) = logits(False), logits(True)
    layers = config.num_hidden_layers
    assert not unplanned_calls
    if fold:   # o and lm_head; down with SwiGLU; qkv and gate_up with the norm before them
        assert planned_calls == {False: layers + 1, True: layers, "norm": 2 * layers}
    else:      # qkv, o, gate_up, lm_head; down with SwiGLU
        assert planned_calls == {False: 3 * layers + 1, True: layers}
    error = ((actual - expected).norm() / expected.norm()).item()
    assert error < 1e-5, error


def test_nothing_is_chosen_on_the_cpu(selection, tiny_model_dir):
    linear_selection, _ = selection
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(load_model_config(tiny_model_dir), TorchAttentionBackend())
    assert linear_selection.select_linear_methods(model, torch.device("cpu"), torch.float32, max_rows=64) == {}
    assert all(layer.plan is None for _, layers in linear_selection.linear_kinds(model).values() for layer in layers)


@requires_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_start_up_choice_on_the_gpu_keeps_the_logits(selection, tiny_model_dir, fp8):
    """The real measurement on a tiny model: every kind gets a plan, and decode batches (GEMV
    rows) and a prompt give the logits of the unplanned model: bf16 within its rounding; FP8
    within what quantizing activations (the unplanned path) changes."""
    linear_selection, _ = selection
    from worker_svc.layers.fp8 import Fp8Config
    from worker_svc.loader import init_dummy_weights

    config = load_model_config(tiny_model_dir)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(config, TorchAttentionBackend(),
                                     quant=Fp8Config(block=(32, 32)) if fp8 else None).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    init_dummy_weights(model, 0, std=0.1)
    kv_cache.allocate_kv_cache(model, 64, 8, config.num_key_value_heads, config.head_dim, torch.bfloat16, "cuda")
    choices = linear_selection.select_linear_methods(model, torch.device("cuda"), torch.bfloat16, max_rows=64)
    assert len(choices) == 5 and all(c.chosen and c.beyond is not None for c in choices.values())
    layers = [layer for _, group in linear_selection.linear_kinds(model).values() for layer in group]
    g = torch.Generator().manual_seed(54)
    for seq_lens, query_lens in [([9] * 3, [1] * 3), ([9] * 20, [1] * 20), ([40], [40])]:
        meta = paged_metadata(random_block_tables(seq_lens, 8, 64, g), seq_lens, query_lens, 8)
        meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).cuda() for f in dataclasses.fields(meta)
                                            if torch.is_tensor(getattr(meta, f.name))})
        ids = torch.randint(0, config.vocab_size, (sum(query_lens),), generator=g).cuda()
        positions = positions_of(seq_lens, query_lens).cuda()
        rows = torch.arange(len(ids), device="cuda")
        with torch.inference_mode():
            planned = model.compute_logits(model(ids, positions, meta), rows).float()
            with pytest.MonkeyPatch.context() as patch:
                for layer in layers:
                    patch.setattr(layer, "plan", None)
                unplanned = model.compute_logits(model(ids, positions, meta), rows).float()
        error = ((planned - unplanned).norm() / unplanned.norm()).item()
        assert error <= (0.15 if fp8 else 2e-2), (query_lens, error)


def test_compile_ahead_turns_launches_into_compiles(selection):
    """Inside compile_ahead a launch only compiles (Triton's warmup), so the variants compile in
    parallel; outside it launches. A call that raises is counted, not propagated."""
    from worker_svc.layers import triton_compile

    class Kernel:
        def __init__(self):
            self.warmed, self.launched = [], []

        def warmup(self, *args, grid, **kwargs):
            self.warmed.append((grid, args, kwargs))

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    kernel = Kernel()

    def fails():
        raise ValueError("no such tile")

    calls = [lambda i=i: triton_compile.launch(kernel, (i,), i, BLOCK=16) for i in range(3)] + [fails]
    assert triton_compile.compile_ahead(calls, threads=2) == 1
    assert [w[0] for w in kernel.warmed] == [(0,), (1,), (2,)] and not kernel.launched
    triton_compile.launch(kernel, (7,), 7, BLOCK=16)
    assert kernel.launched == [((7,), (7,), {"BLOCK": 16})]


@pytest.mark.parametrize("norm_fed", [False, True])
def test_a_method_fed_quantized_input_is_timed_on_it(selection, norm_fed):
    """A runner that takes its input quantized to FP8 (cuBLAS's block-scaled GEMM) is timed on
    input quantized ahead where the layer's RMSNorm quantizes for it (the model runs no
    quantization kernel of the layer's own then), and on the model dtype otherwise."""
    linear_selection, methods = selection
    from worker_svc.layers import fp8_kernels

    g = torch.Generator().manual_seed(53)
    values, scale = quantize_blocks(torch.randn(64, 128, generator=g) * 0.05, (32, 32))
    operands = methods.LinearOperands(values.to(DEVICE), scale.to(DEVICE), (32, 32), norm_fed=norm_fed)
    seen = []

    class Quantizing:
        quant_group = 32

        def __call__(self, x, bias):
            seen.append(type(x).__name__)
            if isinstance(x, fp8_kernels.Fp8Activation):
                dequantized = (x.values.float() * x.scales.repeat_interleave(32, 1))[:x.num_rows].to(x.dtype)
                x = dequantized
            return F.linear(x, operands.dense_weight(x.dtype))

    @dataclasses.dataclass(frozen=True)
    class Fed(methods.Method):
        name = "fed"

        def bind(self, op, dtype):
            return Quantizing()

    def measure(method, runners, x):
        runners[0](x, None)
        return 1.0

    choice = linear_selection.choose_methods("proj", [operands], torch.bfloat16, DEVICE, max_rows=2, sms=4,
                                             measure=measure, candidate_methods=lambda *a: [Fed(), methods.Dequantized()])
    assert {str(m) for m in choice.chosen.values()} == {"fed"}
    # Each row count: the product's check on the model dtype, then the measured call.
    timed = seen[1::2]
    assert timed == (["Fp8Activation"] * 2 if norm_fed else ["Tensor"] * 2) and set(seen[::2]) == {"Tensor"}


def test_few_rows_of_fp8_weights_try_the_fp8_gemm_split_over_k(selection, lc):
    """At a few rows a 4,096-column FP8 weight has 64 column tiles of the FP8 GEMM, fewer programs
    than a Hopper's 132 SMs: the candidates add the GEMM with K split over more programs (both
    activation paths), sized to about SPLIT_PROGRAMS_PER_SM programs an SM with at least two of
    K's groups each; past GEMV_MAX_ROWS only two slices, where the tiles fill less than two waves."""
    linear_selection, methods = selection
    shapes = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 12288), "gate_up": (24576, 4096)}

    def candidates(name, rows):
        operands = methods.LinearOperands(torch.empty(shapes[name], dtype=torch.float8_e4m3fn),
                                          torch.ones(shapes[name][0] // 128, shapes[name][1] // 128), (128, 128),
                                          silu_mul=name == "down", norm_fed=name in ("qkv", "gate_up"))
        return [str(m) for m in lc.candidates(operands, rows, torch.bfloat16, sms=132)]

    def splits(names):   # of the GEMM's own tiles: not those for wgmma at a few rows (swapped, or 64x64 at <= 32)
        own = [n for n in names if n.startswith("fp8-gemm") and "split" in n and "swap" not in n]
        if any(" 16x" in n or " 32x" in n for n in own):
            own = [n for n in own if " 64x" not in n]
        return sorted({re.search(r"split(\d+)", n).group(1) for n in own})

    assert splits(candidates("o", 1)) == ["16"] and splits(candidates("qkv", 1)) == ["11"]
    assert splits(candidates("down", 1)) == ["16"] and splits(candidates("gate_up", 1)) == ["3"]
    one_row = candidates("qkv", 1)
    assert "fp8-gemm(quant+ 16x64 w4 s4 split11)" in one_row and "fp8-gemm(on-load 16x64 w4 s4 split11)" in one_row
    # With PDL (where graphs replay it): the quantized-input GEMM, split and not, prefetching its first weights.
    assert {"fp8-gemm(quant+ 16x64 w4 s4 pdl pf2)", "fp8-gemm(quant+ 16x64 w4 s4 split11 pdl pf2)"} <= set(one_row)
    # The tiles for wgmma on e4m3 (no conversions), input quantized first, split as fp8_split sizes them, with
    # PDL too, never quantized on load: up to 32 rows the rows padded to a 64 x 64 tile; up to 64 the dot swapped
    # (the weight tile as the 64-row operand, swap_rows' 16-64 columns of rows; qkv's 48 tiles of 128 want 16 slices).
    wgmma = [n for n in one_row if " 64x" in n or "swap" in n]
    assert {"fp8-gemm(quant+ 64x64 w4 s4)", "fp8-gemm(quant+ 64x64 w4 s4 split11)",
            "fp8-gemm(quant+ 64x64 w4 s4 split11 pdl pf2)", "fp8-gemm(quant+ 16x64 w4 s4 split11 swap)",
            "fp8-gemm(quant+ 16x128 w4 s4 split16 pdl pf2 swap)", "fp8-gemm(quant+ 16x64 w4 s4 swap)"} <= set(wgmma)
    # the swapped tiles also at a half and a quarter of that split (fewer, longer programs), with PDL too
    assert {"fp8-gemm(quant+ 16x64 w4 s4 split5 swap)", "fp8-gemm(quant+ 16x64 w4 s4 split2 pdl pf2 swap)",
            "fp8-gemm(quant+ 16x128 w4 s4 split4 swap)", "fp8-gemm(quant+ 16x128 w4 s4 split8 pdl pf2 swap)"} <= set(wgmma)
    assert len(wgmma) == 20 and not any("on-load" in n for n in wgmma)   # qkv's norm quantizes its input
    # o and down (no norm before them) also quantize on load in the swapped tiles (down: its SwiGLU too), with PDL
    o_on_load = [n for n in candidates("o", 1) if "swap" in n and "on-load" in n]
    assert "fp8-gemm(on-load 16x64 w4 s4 split8 pdl pf2 swap)" in o_on_load
    assert len(o_on_load) == 8 and all("pdl" in n for n in o_on_load)
    assert len([n for n in candidates("down", 1) if "swap" in n and "on-load" in n]) == 8
    assert lc.swap_splits(4096, 4096, 1, dict(BLOCK_M=16, BLOCK_N=64), 132, 128) == [1, 4, 8, 16]
    assert {"fp8-gemm(quant+ 32x64 w4 s4 swap)", "fp8-gemm(quant+ 64x64 w4 s4)"} <= set(candidates("down", 32))
    at_64 = [n for n in candidates("down", 64) if "swap" in n]
    assert len(at_64) == 18 and all(" 64x" in n for n in at_64)   # 33-64 rows: the GEMM's own tile is 64 x 64 (6 on load)
    # 64 rows: the partials' traffic caps gate_up at 2 slices (4096 / (32 x 64)).
    assert splits(candidates("gate_up", 64)) == ["2"]
    assert splits(candidates("down", 16)) == ["16"] and splits(candidates("o", 16)) == ["8"]
    # Up to 16 rows also narrow column tiles over the whole of K (no split), both activation paths, with PDL too.
    narrow = {"fp8-gemm(quant+ 16x16 w4 s8)", "fp8-gemm(quant+ 16x32 w4 s6)", "fp8-gemm(quant+ 16x16 w4 s8 pdl pf2)",
              "fp8-gemm(quant+ 16x32 w4 s6 pdl pf2)", "fp8-gemm(on-load 16x16 w4 s8)", "fp8-gemm(on-load 16x32 w4 s6)"}
    assert narrow <= set(one_row) and narrow <= set(candidates("down", 16))
    assert not any(n.startswith("fp8-gemm(quant+ 32x16") for n in candidates("o", 32))
    # 128-512 rows: K in two slices for the 64 x 128 tiles where they fill less than two waves (not gate_up).
    assert splits(candidates("o", 256)) == splits(candidates("down", 256)) == splits(candidates("qkv", 256)) == ["2"]
    assert "fp8-gemm(quant+ 64x128 w8 s3 split2)" in candidates("o", 512) and splits(candidates("qkv", 512)) == []
    assert splits(candidates("gate_up", 256)) == [] and splits(candidates("o", 2048)) == []
    # o: 64 tiles would want 17 slices for 8 programs an SM; 32 groups allow 16 of two groups each.
    assert lc.fp8_split(4096, 4096, 1, dict(BLOCK_M=16, BLOCK_N=64), 132, 128) == 16


def test_the_ranks_of_a_group_run_the_slowest_ranks_choice(selection, lc):
    """Here the GEMV wins at 1 and 2 rows; another rank (the reduction: element-wise max with its
    times) finds it slow at 2 rows and cannot run `zeros` (refused here too, on its product): every
    measured row count goes through the reduction once, with one time per candidate in order (inf
    for a refused one), and the choice is the slowest rank's."""
    linear_selection, methods = selection
    gemv = methods.Gemv(lc.GemvConfig(2, 16, 64))

    theirs = {1: [math.inf, 1.0, 0.5], 2: [math.inf, 1.0, 3.0]}   # zeros, cublas, gemv on the other rank
    reduced = []

    def reduce(times):
        reduced.append(list(times))
        return [max(a, b) for a, b in zip(times, theirs[len(reduced)])]

    choice = linear_selection.choose_methods(
        "proj", [bf16_operands(methods)], torch.bfloat16, DEVICE, max_rows=4, sms=4,
        measure=timings({"zeros": 0.1, "cublas": 1.0, "gemv": 0.5}),
        candidate_methods=lambda op, rows, *a: [zeros_method(methods), methods.Cublas(), gemv] if rows <= 2 else [methods.Cublas()],
        reduce_across_ranks=reduce)
    assert reduced == [[math.inf, 1.0, 0.5], [math.inf, 1.0, 0.5]]   # one call per measured row count
    assert [str(m) for m in choice.chosen.values()] == [str(gemv), "cublas", "cublas"]
    assert choice.times[2] == {"cublas": 1.0, str(gemv): 3.0}


def test_the_fastest_pdl_launch_is_timed_with_its_trigger_after_its_loop_too(selection, lc):
    """The fastest PDL launch's twin that lets the next kernel launch only after its loop is timed
    once more (every rank the same twin, through the reduction) and kept where faster: at 1 row
    it beats the early trigger, at 2 rows neither beats cuBLAS but the late twin."""
    linear_selection, methods = selection
    gemv = methods.Gemv(lc.GemvConfig(2, 16, 64, pdl=True))
    late = gemv.late_twin()
    assert str(late) == f"{str(gemv)[:-1]} late)" and late.late_twin() is None
    assert methods.Gemv(lc.GemvConfig(2, 16, 64)).late_twin() is None
    assert methods.Cublas().late_twin() is None
    fp8 = methods.Fp8Gemm.of({"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4, "PDL": True})
    assert str(fp8.late_twin()).endswith("pdl late)") and dict(fp8.late_twin().config)["LATE_TRIGGER"]
    from worker_svc.layers.gemv_kernels import check_config
    with pytest.raises(ValueError, match="late trigger"):
        check_config(lc.GemvConfig(2, 16, 64, late_trigger=True), 48, 64)

    timed = collections.Counter()

    def measure(method, runners, x):
        timed[(x.shape[0], str(method))] += 1
        if str(method) == str(late):
            return 0.4 if x.shape[0] == 1 else 0.9
        if str(method) == str(gemv):
            return 0.5 if x.shape[0] == 1 else 1.2
        return 1.0

    reduced = []

    def reduce(times):
        reduced.append(list(times))
        return times

    choice = linear_selection.choose_methods(
        "proj", [bf16_operands(methods)], torch.bfloat16, DEVICE, max_rows=2, sms=4, measure=measure,
        candidate_methods=lambda *a: [methods.Cublas(), gemv], reduce_across_ranks=reduce)
    assert [str(m) for m in choice.chosen.values()] == [str(late), str(late)]
    assert choice.times[1] == {"cublas": 1.0, str(gemv): 0.5, str(late): 0.4}
    assert choice.times[2] == {"cublas": 1.0, str(gemv): 1.2, str(late): 0.9}
    assert set(timed.values()) == {1} and len(timed) == 6   # each once at each row count
    assert reduced == [[1.0, 0.5], [0.4], [1.0, 1.2], [0.9]]
    # no PDL candidate: nothing more is timed
    reduced.clear()
    plain = methods.Gemv(lc.GemvConfig(2, 16, 64))
    linear_selection.choose_methods("proj", [bf16_operands(methods)], torch.bfloat16, DEVICE, max_rows=1, sms=4,
                                    measure=timings({"cublas": 1.0, "gemv": 0.5}),
                                    candidate_methods=lambda *a: [methods.Cublas(), plain], reduce_across_ranks=reduce)
    assert reduced == [[1.0, 0.5]]


def test_up_to_the_whole_slice_rows_the_fastest_whole_slice_gemv_runs(selection, lc, monkeypatch):
    """WORKER_GEMV_WHOLE_SLICE_ROWS: up to that many rows a kind runs the fastest of its GEMVs that read
    their whole weight slice before the PDL wait, even where cuBLAS or another GEMV timed faster (the
    window they are for is not in the selection's timing); past it, and with it 0, the fastest of all.
    The few-row candidates include them (PDL only)."""
    linear_selection, methods = selection
    operands = bf16_operands(methods)   # 48 columns by 64
    whole = [methods.Gemv(c) for c in lc.whole_slice_configs(1, 64, pdl=True)[:2]]
    other = methods.Gemv(lc.GemvConfig(1, 16, 32, pdl=True))   # two K tiles a program
    names = [str(m) for m in lc.candidates(operands, 1, torch.bfloat16, sms=4)]
    assert all(str(m) in names for m in whole)
    assert not any(str(m) in [str(c) for c in lc.candidates(operands, 1, torch.bfloat16, sms=4, pdl=False)]
                   for m in whole)
    times = {"cublas": 0.2, str(other): 0.3, str(whole[0]): 0.6, str(whole[1]): 0.5}

    def measure(method, runners, x):
        return times.get(str(method), 9.0)   # late twins: slow

    def choose(limit):
        monkeypatch.setattr(linear_selection, "WHOLE_SLICE_ROWS", limit)
        choice = linear_selection.choose_methods("proj", [operands], torch.bfloat16, DEVICE, max_rows=2, sms=4,
                                                 measure=measure, candidate_methods=lambda *a: [methods.Cublas(),
                                                                                                other, *whole])
        return [str(m) for m in choice.chosen.values()]

    assert choose(0) == ["cublas", "cublas"]
    assert choose(1) == [str(whole[1]), "cublas"]
    assert choose(2) == [str(whole[1]), str(whole[1])]
    # FP8 weights (unless WHOLE_SLICE_FP8_MAX_BYTES allows them) and weights past WHOLE_SLICE_MAX_BYTES keep the fastest
    monkeypatch.setattr(linear_selection, "WHOLE_SLICE_ROWS", 1)
    methods_by_name = {"cublas": methods.Cublas(), str(other): other, **{str(m): m for m in whole}}
    pick = linear_selection._preferred(times, methods_by_name, 1, operands)
    assert set(pick) == {str(m) for m in whole}
    fp8 = dataclasses.replace(operands, weight_scale=torch.ones(1, 1), block=(128, 128))
    assert fp8.fp8 and linear_selection._preferred(times, methods_by_name, 1, fp8) == times
    monkeypatch.setattr(linear_selection, "WHOLE_SLICE_FP8_MAX_BYTES", 48 * 64 * 2)   # FP8's own bound, given
    assert set(linear_selection._preferred(times, methods_by_name, 1, fp8)) == {str(m) for m in whole}
    monkeypatch.setattr(linear_selection, "WHOLE_SLICE_MAX_BYTES", 48 * 64 * 2 - 1)
    assert linear_selection._preferred(times, methods_by_name, 1, operands) == times


def test_layers_fed_by_a_norm_also_try_gemvs_that_fold_it_in_at_a_few_rows(selection, lc):
    """qkv and gate_up (norm_fed) get a folded twin of every GEMV but the one-accumulator-a-row loop
    up to FOLD_NORM_MAX_ROWS rows; the SwiGLU-fed down projection and the others never do. Where
    the twins are candidates, every candidate is timed with the norm (as_fed's with_norm), and a
    folded one is checked on a NormedInput against the product of the normalised input."""
    linear_selection, methods = selection
    weight = (torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) / 8).to(torch.bfloat16).to(DEVICE)
    fed = methods.LinearOperands(weight, norm_fed=True)
    for rows in (1, 2, 4, 8):
        names = [str(m) for m in lc.candidates(fed, rows, torch.bfloat16, sms=4)]
        folded = [n for n in names if n.endswith(" +norm")]
        plain = {n for n in names if n.startswith("gemv(") and not n.endswith(" +norm") and " rows" not in n}
        assert bool(folded) == (rows <= lc.FOLD_NORM_MAX_ROWS)
        if folded:
            assert {n.removesuffix(" +norm") for n in folded} == plain and not any(" rows" in n for n in folded)
    for other in (methods.LinearOperands(weight), methods.LinearOperands(weight, silu_mul=True, norm_fed=True)):
        assert not any(str(m).endswith("+norm") for m in lc.candidates(other, 1, torch.bfloat16, sms=4))

    fold = methods.Gemv(lc.GemvConfig(1, 16, 64, split_k=2), fold_norm=True)
    x = (4 * torch.randn(1, 128, generator=torch.Generator().manual_seed(6))).to(torch.bfloat16).to(DEVICE)
    assert linear_selection.relative_error(fold.bind(fed, torch.bfloat16), fed, x) <= 2 ** -7
    broken = dataclasses.replace(fold, config=lc.GemvConfig(1, 16, 64, split_k=2))   # no norm
    assert linear_selection.relative_error(
        methods.NormFoldingRunner(lambda x, bias, norm: broken.bind(fed, torch.bfloat16)(x, bias)), fed, x) > 0.1
    seen = []

    def measure(method, runners, x):
        seen.append(str(method))
        return 0.5 if str(method) == str(fold) else 1.0

    choice = linear_selection.choose_methods("qkv", [fed], torch.bfloat16, DEVICE, max_rows=1, sms=4, measure=measure,
                                             candidate_methods=lambda *a: [methods.Cublas(), fold])
    assert str(choice.chosen[1]) == str(fold) and seen == ["cublas", str(fold)]
    plan = linear_selection.bind_plan(choice, fed, torch.bfloat16)
    assert plan.takes_norm(1) and not plan.takes_norm(2)


def test_start_up_compiles_folded_gemvs_as_the_model_calls_them(selection, monkeypatch):
    """precompile hands a folding GEMV the NormedInput, without and with a residual (two kernel
    variants: the first layer's norm has none), and every other method the plain input."""
    linear_selection, methods = selection
    seen = []

    @dataclasses.dataclass(frozen=True)
    class Recorded(methods.Method):
        fold_norm: bool = False
        compiles = True

        @property
        def name(self):
            return f"recorded{self.fold_norm}"

        def bind(self, operands, dtype):
            def run(x, bias):
                seen.append((self.fold_norm, type(x).__name__,
                             getattr(getattr(x, "norm", None), "residual", None) is not None))
            return run

    monkeypatch.setattr(linear_selection, "compile_ahead", lambda calls: sum(call() or 0 for call in calls))
    fed = bf16_operands(methods)
    assert linear_selection.precompile([fed], torch.bfloat16, DEVICE, max_rows=1, sms=4,
                                       candidate_methods=lambda *a: [Recorded(), Recorded(fold_norm=True)]) == 0
    assert seen == [(False, "Tensor", False), (True, "NormedInput", False), (True, "NormedInput", True)]


def test_past_the_gemv_rows_bf16_layers_try_the_tiled_tensor_core_loop_against_cublas(selection, lc):
    """From GEMV_MAX_ROWS to TILED_MAX_ROWS rows a bf16 kind's candidates are cuBLAS and the GEMV
    kernel's tensor-core loop as a tiled GEMM (TILED_TILES, split over K where the tiles fill less
    than two waves); FP8 kinds and larger steps keep their lists. The tiled product matches F.linear."""
    linear_selection, methods = selection
    from worker_svc.layers.gemv_kernels import check_config

    configs = lc.tiled_configs(256, 4096, 1024, sms=132)   # Qwen3-0.6B's qkv at 256 rows
    assert [c for c in configs if c.split_k == 1] == [
        lc.GemvConfig(m, n, k, num_warps=w, num_stages=s) for m, n, k, w, s in lc.TILED_TILES]
    split = {(c.block_m, c.block_n): c.split_k for c in configs if c.split_k > 1}
    # 256, 128, 128 and 64 tiles for 264 programs' two waves; at most a quarter of K's 16 tiles a slice
    assert split == {(64, 64): 2, (64, 128): 3, (128, 64): 3, (128, 128): 4}
    for cfg in configs:
        check_config(cfg, 4096, 1024)
    weight = (torch.randn(96, 128, generator=torch.Generator().manual_seed(7)) / 11).to(torch.bfloat16).to(DEVICE)
    bf16, fp8 = methods.LinearOperands(weight), methods.LinearOperands(*quantize_blocks(weight.float().cpu(), (32, 32)),
                                                                        (32, 32))
    for rows in (128, 512, 2048):
        names = [str(m) for m in lc.candidates(bf16, rows, torch.bfloat16, sms=4)]
        tiled = [n for n in names if n.startswith("gemv(")]
        assert names[0] == "cublas" and bool(tiled) == (rows <= lc.TILED_MAX_ROWS)
        assert all(n.startswith(("gemv(m64", "gemv(m128")) for n in tiled)
    assert not any(str(m).startswith("gemv") for m in lc.candidates(fp8, 256, torch.bfloat16, sms=4))
    x = torch.randn(100, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(DEVICE)
    for cfg in (lc.GemvConfig(64, 32, 32, num_warps=4, num_stages=2),
                lc.GemvConfig(64, 32, 32, split_k=2, num_warps=4, num_stages=2)):
        run = methods.Gemv(cfg, max_rows=lc.TILED_MAX_ROWS).bind(bf16, torch.bfloat16)
        assert linear_selection.relative_error(run, bf16, x) <= 2 ** -7
