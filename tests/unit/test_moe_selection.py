"""The start-up choice of the FP8 experts' activation mode (worker_svc/layers/moe_selection.py):
which mode each token count runs, with injected timings on a tiny FP8 expert stack (its
kernels under Triton's interpreter without CUDA); that a MoE block runs the mode chosen for
its token count; and that a failed measurement leaves the rows-per-expert rule, with a warning."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, gpu_faithful
from tests.support.markers import requires_cuda
from worker_svc.layers.fp8 import Fp8Config


@pytest.fixture(scope="module")
def selection():
    pytest.importorskip("triton", reason="triton is not installed")
    from worker_svc.layers import moe_kernels, moe_selection

    with gpu_faithful():
        yield moe_selection, moe_kernels


def fp8_experts(num_experts=4, hidden=64, intermediate=64):
    from worker_svc.layers.moe import FusedExperts

    with torch.device(DEVICE):
        experts = FusedExperts(num_experts, hidden, intermediate, Fp8Config(block=(32, 32)))
    g = torch.Generator(device=DEVICE).manual_seed(61)
    for name in ("w13_weight", "w2_weight"):
        getattr(experts, name).init_dummy(g, 0.05)
    return experts


def fp8_moe_block():
    """A SparseMoeBlock of fp8_experts(): 4 experts, top-2, hidden 64."""
    from worker_svc.layers.moe import SparseMoeBlock

    class Config:
        hidden_act, num_experts_per_tok, norm_topk_prob = "silu", 2, True
        hidden_size, num_experts, moe_intermediate_size = 64, 4, 64

    with torch.device(DEVICE):
        block = SparseMoeBlock(Config, Fp8Config(block=(32, 32)))
    block.experts = fp8_experts()
    return block


def test_each_token_count_runs_the_faster_mode(selection):
    """on_load is timed faster from 8 tokens on here, the swapped dot of activations quantized first
    fastest at 16: the buckets up to 4 keep weight_only (the tie at 4 too: no quantization where it
    buys nothing), 8 takes on_load, 16 and the counts past the last bucket given_swap."""
    moe_selection, _ = selection
    timed = []

    def measure(runs, x):
        mode = runs[0].keywords["mode"]
        assert [r.keywords["experts"] for r in runs] == layers and {r.keywords["mode"] for r in runs} == {mode}
        timed.append((x.shape[0], mode))
        tokens = x.shape[0]
        return {"weight_only": 1.0, "on_load": 2.0 if tokens < 4 else (1.0 if tokens == 4 else 0.5),
                "given_m64": 3.0, "on_load_swap": 3.0, "given_swap": 0.25 if tokens == 16 else 3.0}[mode]

    layers = [fp8_experts(), fp8_experts()]   # timed in turn: experts of other layers, as serving reads them
    modes = moe_selection.choose_fp8_modes(layers, 2, torch.bfloat16, DEVICE, max_tokens=16, measure=measure)
    assert modes.bounds == [1, 2, 4, 8, 16]
    assert modes.modes == ["weight_only", "weight_only", "weight_only", "on_load", "given_swap"]
    assert [modes.mode_for(n) for n in (1, 3, 4, 5, 16, 17, 4096)] == [
        "weight_only", "weight_only", "weight_only", "on_load", "given_swap", "given_swap", "given_swap"]
    assert moe_selection.MODES == ("weight_only", "on_load", *selection[1].WIDE_MODES)
    assert sorted(set(timed)) == sorted({(t, m) for t in modes.bounds for m in moe_selection.MODES})
    assert ("8: on_load (weight_only 1.0000 / on_load 0.5000 / given_m64 3.0000 / on_load_swap 3.0000 / "
            "given_swap 3.0000)") in modes.summary()


def test_a_mode_that_strays_from_the_weight_only_product_is_never_chosen(selection, monkeypatch):
    moe_selection, _ = selection
    monkeypatch.setattr(moe_selection.linear_selection, "ACTIVATION_QUANT_TOLERANCE", 0.0)
    modes = moe_selection.choose_fp8_modes([fp8_experts()], 2, torch.bfloat16, DEVICE, max_tokens=4,
                                           measure=lambda runs, x: 1.0 if runs[0].keywords["mode"] == "weight_only"
                                           else 0.1)
    assert modes.modes == ["weight_only"] * 3 and modes.beyond == "weight_only"
    assert set(modes.rejected) == {1, 2, 4} and "relative error" in modes.rejected[1]


def test_the_moe_block_runs_the_mode_chosen_for_its_token_count(selection, monkeypatch):
    moe_selection, moe_kernels = selection
    block = fp8_moe_block()
    block.gate.weight.data = (torch.randn(4, 64, device=DEVICE) * 0.1).to(torch.bfloat16)
    seen = []
    real = moe_kernels.fused_experts

    def spy(*args, fp8_activations=None, **kwargs):
        seen.append(fp8_activations)
        return real(*args, fp8_activations=fp8_activations, **kwargs)

    monkeypatch.setattr(moe_kernels, "fused_experts", spy)
    x = torch.randn(5, 64, device=DEVICE).to(torch.bfloat16)
    block(x[:2])
    assert seen == [None]   # nothing measured: the rows-per-expert rule decides inside
    block.fp8_modes = moe_selection.Fp8Modes([2, 4, 8], ["weight_only", "on_load", "weight_only"])
    for tokens in (1, 3, 5):
        block(x[:tokens])
    assert seen[1:] == ["weight_only", "on_load", "weight_only"]


def test_a_failed_measurement_keeps_the_rule_and_says_so(selection, monkeypatch, caplog):
    """Nothing is installed and one WARNING names the failure; the worker starts regardless."""
    moe_selection, _ = selection
    model = torch.nn.Sequential(fp8_moe_block())

    def failing(*args, **kwargs):
        raise RuntimeError("no graphs here")

    monkeypatch.setattr(moe_selection, "choose_fp8_modes", failing)
    with caplog.at_level(logging.WARNING, logger="worker_svc.layers.moe_selection"):
        assert moe_selection.select_fp8_modes(model, torch.device("cuda"), torch.bfloat16, max_tokens=8) is None
    assert model[0].fp8_modes is None
    assert "RuntimeError: no graphs here" in caplog.text and "rows-per-expert rule" in caplog.text
    # On the CPU nothing is measured at all.
    assert moe_selection.select_fp8_modes(model, torch.device("cpu"), torch.bfloat16, max_tokens=8) is None


@requires_cuda
def test_on_a_gpu_every_mode_is_timed_in_cuda_graphs(selection):
    moe_selection, _ = selection
    experts = fp8_experts(num_experts=8, hidden=256, intermediate=256)
    modes = moe_selection.choose_fp8_modes([experts, fp8_experts(num_experts=8, hidden=256, intermediate=256)], 2,
                                           torch.bfloat16, torch.device(DEVICE), max_tokens=64)
    assert modes.bounds == [1, 2, 4, 8, 16, 32, 64] and set(modes.modes) <= set(moe_selection.MODES)
    assert all(t > 0 for times in modes.times.values() for t in times.values())
    assert all(len(modes.times[b]) == len(moe_selection.MODES) for b in modes.bounds if b not in modes.rejected)


def test_the_ranks_agree_and_a_bucket_that_fails_here_still_reduces_once(selection):
    """Here on_load is faster everywhere; another rank finds it slower at 4 tokens. At 2 tokens
    on_load's measurement raises here: the bucket still goes through the reduction once, on_load
    as inf, so no rank runs it there (the other modes are still timed). Where no mode runs on some rank
    the choice raises after the last bucket (every rank the same; select_fp8_modes then keeps the rule)."""
    moe_selection, _ = selection
    inf = float("inf")
    reduced = []
    theirs = {1: [1.0, 0.5, 3.0, 3.0, 3.0], 2: [1.0, 0.5, 3.0, 3.0, 3.0], 4: [1.0, 2.0, 3.0, 3.0, 3.0]}

    def measure(runs, x, failing=("on_load",)):
        mode = runs[0].keywords["mode"]
        if x.shape[0] == 2 and mode in failing:
            raise RuntimeError("out of memory")
        return {"weight_only": 1.0, "on_load": 0.5, "given_m64": 3.0, "on_load_swap": 3.0, "given_swap": 3.0}[mode]

    def reduce(times):
        reduced.append(list(times))
        return [max(a, b) for a, b in zip(times, theirs[[1, 2, 4][len(reduced) - 1]])]

    modes = moe_selection.choose_fp8_modes([fp8_experts()], 2, torch.bfloat16, DEVICE, max_tokens=4,
                                           measure=measure, reduce_across_ranks=reduce)
    assert reduced == [[1.0, 0.5, 3.0, 3.0, 3.0], [1.0, inf, 3.0, 3.0, 3.0], [1.0, 0.5, 3.0, 3.0, 3.0]]
    assert modes.modes == ["on_load", "weight_only", "weight_only"] and "out of memory" in modes.rejected[2]
    with pytest.raises(RuntimeError, match=r"no mode runs at \[2\] tokens"):
        moe_selection.choose_fp8_modes([fp8_experts()], 2, torch.bfloat16, DEVICE, max_tokens=4,
                                       measure=lambda runs, x: measure(runs, x, failing=moe_selection.MODES))
