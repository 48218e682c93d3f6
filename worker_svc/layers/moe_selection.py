"""The start-up choice of how FP8 experts take their activations (moe_kernels.FP8_ACTIVATIONS),
by token count, measured as linear_selection measures the linear layers.

The grouped GEMM multiplies FP8 expert weights either by bf16 activations, converting each weight
tile for the dot ("weight_only": nothing quantized, the conversion's cost on every weight), or by
activations quantized per token group as it loads them ("on_load": FP8 x FP8 on the tensor
cores, the activation tile converted instead), or FP8 x FP8 on tiles Hopper's wgmma takes e4m3
from, where the 16-row blocks run f16 mma.sync converting every element (PERF_NOTES v41): the rows
padded to 64-row blocks ("given_m64") or the dot swapped ("on_load_swap", "given_swap";
moe_kernels.WIDE_MODES). Which is faster depends
on the rows each expert gets and the GPU (PERF_NOTES v36-v37: the dense layers' weight-only paths
read ~1.8 TB/s on an H200 where FP8 x FP8 reads 3.4); `moe_kernels.default_fp8_activations`
guesses by rows per expert. Here each token-count bucket of linear_selection.row_buckets times
every mode (MODES) on the model's own experts (random routing, as decode spreads tokens; the
layers in turn, up to TIMED_LAYERS, so the experts a few tokens touch come from memory, not L2, as
when serving) in a CUDA graph, keeps an FP8 x FP8 mode only where its product stays within
ACTIVATION_QUANT_TOLERANCE of the weight-only one, and the
SparseMoeBlocks then ask `Fp8Modes.mode_for(num_tokens)`. Any failure leaves the guess in place
(one WARNING). Under tensor parallelism each rank measures its own shards and the ranks agree on
the slowest rank's times, as the linear and attention selections do. Nothing on the CPU, with WORKER_LINEAR_KERNELS=0 or WORKER_MOE_FP8_SELECTION=0 (the
rule decides: the A/B), or for bf16 experts.
"""
from __future__ import annotations

import bisect
import functools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from worker_svc.layers import linear_selection

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("WORKER_MOE_FP8_SELECTION", "1") != "0"
MODES = ("weight_only", "on_load", "given_m64", "on_load_swap", "given_swap")   # the last three: WIDE_MODES
# Layers timed in turn: one token's 8 experts of Qwen3-30B-A3B are 38 MB, under an H100's 50 MB of
# L2; 16 layers' are 600 MB.
TIMED_LAYERS = 16
# A mode's time: (runs, x) -> ms per call, each run (one layer's) a functools.partial with
# keywords["mode"]. Real runs: linear_selection.graph_time's CUDA graph calling them in turn.
Measure = Callable[[list[Callable[[torch.Tensor, None], torch.Tensor]], torch.Tensor], float]


@dataclass
class Fp8Modes:
    """The mode each token count runs: modes[i] up to bounds[i] tokens (above bounds[i - 1]),
    the last bound's past it; with what was measured."""
    bounds: list[int]
    modes: list[str]
    times: dict[int, dict[str, float]] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)

    @property
    def beyond(self) -> str:
        return self.modes[-1]

    def mode_for(self, num_tokens: int) -> str:
        return self.modes[min(bisect.bisect_left(self.bounds, num_tokens), len(self.modes) - 1)]

    def summary(self) -> str:
        parts = []
        for tokens, mode in zip(self.bounds, self.modes):
            times = self.times.get(tokens, {})
            timing = " / ".join(f"{m} {t:.4f}" for m, t in times.items())
            parts.append(f"{tokens}: {mode}" + (f" ({timing})" if timing else "")
                         + (f" [refused: {self.rejected[tokens]}]" if tokens in self.rejected else ""))
        return "; ".join(parts) + f"; >{self.bounds[-1]}: {self.beyond}"


def _graph_measure(runs: list[Callable], x: torch.Tensor) -> float:
    return linear_selection.graph_time(None, runs, x)


def choose_fp8_modes(layers: list[nn.Module], top_k: int, dtype: torch.dtype, device: torch.device, *,
                     max_tokens: int, measure: Measure = _graph_measure,
                     reduce_across_ranks: linear_selection.Reduce | None = None) -> Fp8Modes:
    """Times both modes at each token bucket on `layers` (moe.FusedExperts in FP8 of one shape),
    the first's product checked, all of them timed in turn. With `reduce_across_ranks` every
    bucket's two times (inf where refused or failed here) go through it once on every rank, so the
    ranks agree; a bucket where neither mode ran anywhere raises, after the last bucket."""
    from worker_svc.layers import moe_kernels

    num_experts, hidden = layers[0].w13_weight.shape[0], layers[0].w2_weight.shape[1]
    generator = torch.Generator(device=device).manual_seed(0)
    bounds, modes, times, rejected = [], [], {}, {}
    for tokens in linear_selection.row_buckets(max_tokens):
        x = torch.randn(tokens, hidden, generator=generator, device=device).to(dtype)
        logits = torch.randn(tokens, num_experts, generator=generator, device=device).to(dtype)
        weights, ids = moe_kernels.route_topk(logits, top_k, True)

        def run(x_in, _bias=None, *, mode, experts, weights=weights, ids=ids):
            return moe_kernels.fused_experts(
                x_in, experts.w13_weight, experts.w2_weight, weights, ids, fp8_activations=mode,
                w13_scale=experts.w13_weight_scale_inv, w2_scale=experts.w2_weight_scale_inv, block=experts.quant.block)

        runs = {mode: [functools.partial(run, mode=mode, experts=e) for e in layers] for mode in MODES}
        timed = dict.fromkeys(MODES, math.inf)
        reference = None
        try:
            reference = runs["weight_only"][0](x).float()
            timed["weight_only"] = measure(runs["weight_only"], x)
        except Exception as exc:  # noqa: BLE001 - inf: the ranks still agree, once per bucket
            rejected[tokens] = f"weight_only: {type(exc).__name__}: {exc}"[:300]
        for mode in MODES[1:] if reference is not None else ():   # FP8 x FP8, checked against weight-only first
            try:
                error = ((runs[mode][0](x).float() - reference).norm() / reference.norm().clamp_min(1e-30)).item()
                if error <= linear_selection.ACTIVATION_QUANT_TOLERANCE:
                    timed[mode] = measure(runs[mode], x)
                else:
                    rejected.setdefault(tokens, f"{mode}: relative error {error:.3g} > "
                                                f"{linear_selection.ACTIVATION_QUANT_TOLERANCE}")
            except Exception as exc:  # noqa: BLE001 - inf: the ranks still agree, once per bucket
                rejected.setdefault(tokens, f"{mode}: {type(exc).__name__}: {exc}"[:300])
        if reduce_across_ranks is not None:
            timed = dict(zip(MODES, reduce_across_ranks([timed[mode] for mode in MODES])))
        timed = {mode: t for mode, t in timed.items() if math.isfinite(t)}
        bounds.append(tokens)
        modes.append(min(timed, key=timed.get) if timed else "")   # ties keep weight_only (listed first)
        times[tokens] = timed
    failed = [tokens for tokens, mode in zip(bounds, modes) if not mode]
    if failed:
        raise RuntimeError(f"no mode runs at {failed} tokens: {[rejected.get(t) for t in failed]}")
    return Fp8Modes(bounds, modes, times, rejected)


def select_fp8_modes(model: nn.Module, device: torch.device, dtype: torch.dtype, *, max_tokens: int,
                     measure: Measure = _graph_measure,
                     reduce_across_ranks: linear_selection.Reduce | None = None) -> Fp8Modes | None:
    """Chooses on the FP8 MoE blocks (their experts have one shape; up to TIMED_LAYERS timed) and
    installs the choice on every one; None where there is nothing to choose or the measurement
    failed."""
    from worker_svc.layers.moe import SparseMoeBlock

    device = torch.device(device)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.experts.is_fp8]
    if not blocks or device.type != "cuda" or not linear_selection.ENABLED or not ENABLED:
        return None
    try:
        with torch.inference_mode():
            choice = choose_fp8_modes([b.experts for b in blocks[:TIMED_LAYERS]], blocks[0].top_k, dtype, device,
                                      max_tokens=max_tokens, measure=measure, reduce_across_ranks=reduce_across_ranks)
    except Exception as exc:  # noqa: BLE001 - the rows-per-expert guess stays: slower at worst, never wrong
        logger.warning("timing the FP8 experts' activation modes failed (%s: %s); they follow the rows-per-expert "
                       "rule (moe_kernels.default_fp8_activations)", type(exc).__name__, str(exc)[:300])
        return None
    finally:
        torch.cuda.empty_cache()
    for block in blocks:
        block.fp8_modes = choice
    logger.info("FP8 experts (%d layers), activation mode by tokens, ms per call: %s", len(blocks),
                choice.summary())
    return choice
