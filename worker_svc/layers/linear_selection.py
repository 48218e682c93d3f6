"""Start-up choice of how each kind of linear layer computes its product, by measurement.

A kind is the layers of one name and shape (qkv_proj, o_proj, gate_up_proj, down_proj,
lm_head; a tensor-parallel rank sees its own shards). At each row count of ROW_BUCKETS up to
what a step can hold, every candidate method (linear_candidates; linear_methods) is first checked against the
product in float32 on random input, then timed as the decode graphs run it: CUDA-graph
replays of one call per layer of the kind in turn, so weights stream from memory as they do in
the model instead of sitting in L2, and with the input the model gives (a method that takes
its input quantized to FP8 from the RMSNorm before the layer gets it so: `as_fed`; at the few
row counts where a layer fed by an RMSNorm also tries GEMVs that fold that norm in, every
candidate is timed with the norm as the model runs it, so those rows' times include it). The fastest
wins each row count (ties: the earlier candidate; cuBLAS, or for FP8 weights the FP8 GEMM,
comes first, so no measured shape is slower than it; but at one row a small weight's GEMVs that read
their whole slice before their PDL wait are preferred, which this timing cannot show faster and the
decode step does: WHOLE_SLICE_ROWS), and each layer gets a LinearPlan that runs the winner for its
row count. A bf16 copy of FP8 weights is kept only where it beats every FP8 method by DEQUANTIZED_MARGIN.

One log line per kind gives the winners and their times. This runs after the weights are
loaded and before the KV cache is sized and the graphs are captured; it compiles the Triton
candidates (Triton keeps them on disk for the next start) and takes a few seconds more.
Tensor-parallel ranks choose on their own: a choice changes a rank's speed, never its result
beyond rounding. WORKER_LINEAR_KERNELS=0 in the worker's environment leaves every layer on
cuBLAS / the FP8 GEMM as before (for comparisons).
"""
from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.layers import fp8_kernels, fused_kernels
from worker_svc.layers.gemv_kernels import FoldedNorm, whole_slice
from worker_svc.layers.pdl_launch import pdl_in_graphs
from worker_svc.layers.layernorm import rms_norm
from worker_svc.layers.linear_candidates import candidates
from worker_svc.layers.linear_methods import (Fp8Cublas, Fp8Gemm, Gemv, LinearOperands, LinearPlan, Method, NormedInput,
                                              Runner)
from worker_svc.layers.triton_compile import compile_ahead

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("WORKER_LINEAR_KERNELS", "1") != "0"
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048)
TIMED_CALLS, TIMED_ROUNDS = 24, 3
L2_MULTIPLE = 4                 # timed layers: enough for their weights to exceed 4 L2 caches
DEQUANTIZED_MARGIN = 0.9
# Largest relative L2 error against the float32 product: bf16 rounding of the operands (and of
# FP8 weights' dequantization) stays far below the first; quantizing activations to FP8
# (4 mantissa bits) below the second.
TOLERANCE, ACTIVATION_QUANT_TOLERANCE = 0.02, 0.1
REFERENCE_COLUMNS = 4096        # output columns the check compares
# Up to this many rows (0: none) a kind whose weight is at most WHOLE_SLICE_MAX_BYTES runs the fastest of its
# GEMVs that read their whole weight slice before their PDL wait (gemv_kernels.whole_slice), where it has any:
# those are for the window the kernels before them in the decode layer's chain leave the memory idle
# (attention, the norms), which this back-to-back timing of one kind does not contain. On an H100 (PERF_NOTES
# v46) Qwen3-0.6B's one-row decode step took 1.15 -> 1.08 ms of device time with them; at 2 and 4 rows 1.30 ->
# 1.45 and 1.42 -> 2.89 (there they run one row of programs per weight row and lose to every other loop). From 16
# rows it reaches the tensor-core ones (early_dot), which lost when forced (v50: 16 x 1024 1.91-1.94 -> 2.08 ms,
# 64 x 1024 3.77-3.84 -> 4.57): the timing alone picks them where they are fastest.
WHOLE_SLICE_ROWS = int(os.environ.get("WORKER_GEMV_WHOLE_SLICE_ROWS", "1"))
# The largest 16-bit weight they were measured to gain on: Qwen3-0.6B's gate_up (12 MiB). Larger ones are not
# measured (Qwen3-8B's) or lose (the LM head, 297 MiB, 7% slower: its programs cannot hold their slices at once).
# FP8 weights keep their timed choice unless WORKER_GEMV_WHOLE_SLICE_FP8_MAX_MIB gives them a bound of their own
# (default 0: none): on an H100 (PERF_NOTES v47) Qwen3-8B's FP8 qkv (24 MiB) and o (16 MiB) on them made the one-row
# step 29% slower (the FMA loop converts each FP8 weight to float32: 34.6 us for qkv against the FP8 GEMM's 14.7).
WHOLE_SLICE_MAX_BYTES = int(float(os.environ.get("WORKER_GEMV_WHOLE_SLICE_MAX_MIB", "12")) * (1 << 20))
WHOLE_SLICE_FP8_MAX_BYTES = int(float(os.environ.get("WORKER_GEMV_WHOLE_SLICE_FP8_MAX_MIB", "0")) * (1 << 20))
CHECK_NORM_EPS = 1e-6           # the RMSNorm's epsilon where a folded norm is checked and timed


@dataclass
class KindChoice:
    """What was measured for one kind of layer and what it runs."""
    label: str
    num_layers: int
    times: dict[int, dict[str, float]] = field(default_factory=dict)   # rows -> method -> ms per call
    chosen: dict[int, Method] = field(default_factory=dict)             # rows bound -> method
    beyond: Method | None = None                                         # rows past the last bound
    rejected: dict[str, str] = field(default_factory=dict)              # method -> why

    def summary(self) -> str:
        """rows: winner, its ms and the runner-up's, for each row count measured."""
        parts = []
        for rows, method in self.chosen.items():
            ms = self.times.get(rows, {})
            if not ms:
                parts.append(f"{rows}: {method}")
                continue
            others = [t for name, t in ms.items() if name != str(method)]
            runner_up = f" (next {min(others):.4f})" if others else ""
            parts.append(f"{rows}: {method} {ms[str(method)]:.4f}{runner_up}")
        parts.append(f">{max(self.chosen)}: {self.beyond}")
        return "; ".join(parts)

    def table(self) -> str:
        """rows: every candidate measured there, quickest first, with its ms (what summary leaves out)."""
        return "; ".join(f"{rows}: " + ", ".join(f"{name} {ms:.4f}" for name, ms in sorted(times.items(), key=lambda kv: kv[1]))
                         for rows, times in self.times.items() if times)


Measure = Callable[[Method, list[Runner], torch.Tensor], float]
Reduce = Callable[[list[float]], list[float]]   # every rank's values -> their element-wise maximum


def graph_time(method: Method, runners: list[Runner], x: torch.Tensor) -> float:
    """Milliseconds per call: one CUDA graph calling each runner in turn (repeated to about
    TIMED_CALLS calls), the median of TIMED_ROUNDS replays."""
    repeats = max(1, math.ceil(TIMED_CALLS / len(runners)))
    for run in runners:
        run(x, None)
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for run in runners:
                run(x, None)
    graph.replay()
    results = []
    for _ in range(TIMED_ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end) / (repeats * len(runners)))
    del graph
    return statistics.median(results)


def relative_error(run: Runner, operands: LinearOperands, x: torch.Tensor) -> float:
    """Relative L2 error of run(x) over the first REFERENCE_COLUMNS columns, against the product
    in float32 (of the dequantized weight for FP8)."""
    columns = min(REFERENCE_COLUMNS, operands.weight.shape[0])
    part = LinearOperands(operands.weight[:columns], silu_mul=operands.silu_mul)
    if operands.fp8:
        bn = operands.block[0]
        part = LinearOperands(operands.weight[:columns], operands.weight_scale[:math.ceil(columns / bn)],
                              operands.block, operands.silu_mul)
    if getattr(run, "takes_norm", False):   # checked as the model runs it: on an RMSNorm's NormedInput
        ones = torch.ones_like(x[0])
        expected_input = rms_norm(x, ones, CHECK_NORM_EPS)
        actual = run(NormedInput(x, FoldedNorm(ones, CHECK_NORM_EPS)), None)[:, :columns].float()
    else:
        expected_input = part.activate(x)
        actual = run(x, None)[:, :columns].float()
    expected = F.linear(expected_input.float(), part.dense_weight(torch.float32))
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def as_fed(runners: list[Runner], operands: LinearOperands, x: torch.Tensor, with_norm: bool = False) -> list[Runner]:
    """The runners as the model calls them: one that takes its input quantized to FP8 (its
    `quant_group`) gets x quantized once, ahead, where the RMSNorm before the layer quantizes its
    output for it; its own quantization kernel does not run in the model, so it is not timed.
    `with_norm` (a row count where some candidate folds the norm in): each runner is timed with
    the norm's kernel before it as the model runs it (the FP8 norm for one taking FP8, the bf16 one
    otherwise), and one that folds the norm in gets the NormedInput instead."""
    if with_norm:
        return _with_norm(runners, x)
    if not (operands.norm_fed and fused_kernels.ENABLED and fused_kernels.FP8_QUANT_FUSION):
        return runners
    quantized: dict[int, fp8_kernels.Fp8Activation] = {}   # by group: one quantization for every layer's runner
    fed = []
    for run in runners:
        group = getattr(run, "quant_group", None)
        if group is None:
            fed.append(run)
        else:
            if group not in quantized:
                quantized[group] = fp8_kernels.quantize_activation(x, group)
            fed.append(lambda _x, bias, run=run, q=quantized[group]: run(q, bias))
    return fed


def _with_norm(runners: list[Runner], x: torch.Tensor) -> list[Runner]:
    """as_fed's `with_norm`: each runner behind the norm kernel the model would run before it
    (none for one that folds the norm in), with a residual, as every layer but the first has."""
    g = torch.Generator(device=x.device).manual_seed(1)
    weight = (torch.rand(x.shape[-1], generator=g, device=x.device) + 0.5).to(x.dtype)
    residual = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
    total = torch.empty_like(x)
    quant_fused = fused_kernels.FP8_QUANT_FUSION
    fed = []
    for run in runners:
        group = getattr(run, "quant_group", None)
        if getattr(run, "takes_norm", False):
            fed.append(lambda _x, bias, run=run: run(NormedInput(x, FoldedNorm(weight, CHECK_NORM_EPS, residual, total)),
                                                     bias))
        elif group is not None and quant_fused:
            fed.append(lambda _x, bias, run=run, group=group: run(
                fused_kernels.rms_norm_fp8(x, weight, CHECK_NORM_EPS, residual, group)[0], bias))
        else:
            fed.append(lambda _x, bias, run=run: run(fused_kernels.rms_norm(x, weight, CHECK_NORM_EPS, residual)[0], bias))
    return fed


def _check_fp8_fusion(kinds: Sequence[LinearOperands], device: torch.device, dtype: torch.dtype) -> None:
    """Leaves the FP8 quantization to its own kernel (fused_kernels.FP8_QUANT_FUSION off) where
    the fused kernels fail their start-up check on this device; logged once."""
    if not (fused_kernels.ENABLED and fused_kernels.FP8_QUANT_FUSION and any(op.fp8 for op in kinds)):
        return
    fault = fused_kernels.fp8_fusion_fault(device, dtype)
    if fault is not None:
        fused_kernels.FP8_QUANT_FUSION = False
        logger.warning("FP8 activations are quantized by their own kernel: the fused kernels failed their "
                       "start-up check (%s)", fault)


def _timed_layers(operands: Sequence[LinearOperands], device: torch.device) -> list[LinearOperands]:
    """The first layers whose weights together exceed L2_MULTIPLE L2 caches (or all of them)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if device.type == "cuda" else 0
    chosen, total = [], 0
    for op in operands:
        chosen.append(op)
        total += op.weight.numel() * op.weight.element_size()
        if total >= L2_MULTIPLE * l2:
            break
    return chosen


def row_buckets(max_rows: int) -> list[int]:
    """The row counts measured: ROW_BUCKETS up to max_rows, which is always one."""
    return sorted({b for b in ROW_BUCKETS if b < max_rows} | {min(max_rows, ROW_BUCKETS[-1])})


def precompile(kinds: Sequence[LinearOperands], dtype: torch.dtype, device: torch.device, *, max_rows: int,
               sms: int, candidate_methods: Callable[..., list[Method]] = candidates) -> int:
    """Compiles every Triton candidate of these kinds (one layer's operands each) at every row
    count in parallel (triton_compile); returns how many failed to compile."""
    calls = []
    for operands in kinds:
        for rows in row_buckets(max_rows):
            x = torch.zeros(rows, operands.input_width, dtype=dtype, device=device)
            methods = candidate_methods(operands, rows, dtype, sms)
            methods += [twin for twin in (m.late_twin() for m in methods) if twin is not None]
            ones = torch.ones(operands.input_width, dtype=dtype, device=device)
            # as the model calls a folding GEMV: both variants (the first layer's norm has no residual)
            normed_inputs = [NormedInput(x, FoldedNorm(ones, CHECK_NORM_EPS, residual)) for residual in (None, x)]
            for method in methods:
                if not method.compiles:
                    continue
                if getattr(method, "fold_norm", False):
                    calls += [lambda m=method, op=operands, normed=normed: m.bind(op, dtype)(normed, None)
                              for normed in normed_inputs]
                else:
                    calls.append(lambda m=method, op=operands, x=x: m.bind(op, dtype)(x, None))
    return compile_ahead(calls)


def choose_methods(label: str, operands: Sequence[LinearOperands], dtype: torch.dtype, device: torch.device, *,
                   max_rows: int, sms: int, measure: Measure = graph_time,
                   candidate_methods: Callable[..., list[Method]] = candidates,
                   reduce_across_ranks: Reduce | None = None) -> KindChoice:
    """Measures the candidates of one kind of layer (operands: every layer of the kind) at each
    row count up to max_rows; returns what each row count runs. With `reduce_across_ranks` (a
    tensor-parallel group) the ranks agree: each row count's times, one per candidate in the
    candidates' order (inf where refused here), go through it once on every rank, so every rank
    runs the same kernels (a rank that ran a slower one would hold every all-reduce up)."""
    choice = KindChoice(label, len(operands))
    timed = _timed_layers(operands, device)
    generator = torch.Generator(device=device).manual_seed(0)
    unbounded: dict[str, tuple[Method, float]] = {}
    for rows in row_buckets(max_rows):
        x = torch.randn(rows, operands[0].input_width, generator=generator, device=device).to(dtype)
        methods: dict[str, Method] = {}
        every = candidate_methods(operands[0], rows, dtype, sms)   # the same on every rank
        listed = [m for m in every if str(m) not in choice.rejected]
        if len(every) == 1:   # nothing to choose between (cuBLAS past the GEMV's rows)
            choice.times[rows], choice.chosen[rows] = {}, every[0]
            unbounded = {str(every[0]): (every[0], 0.0)} if every[0].max_rows is None else {}
            continue

        times: dict[str, float] = {}
        with_norm = any(getattr(m, "fold_norm", False) for m in every)   # the same on every rank
        for method in listed:
            elapsed = _time_method(method, label, rows, x, operands, timed, dtype, measure, choice.rejected, with_norm)
            if math.isfinite(elapsed):
                times[str(method)], methods[str(method)] = elapsed, method
        if reduce_across_ranks is not None:
            agreed = reduce_across_ranks([times.get(str(m), math.inf) for m in every])
            times = {str(m): t for m, t in zip(every, agreed) if str(m) in times and math.isfinite(t)}
        if not times:
            raise RuntimeError(f"linear {label}: no method runs at {rows} rows ({choice.rejected})")
        # The fastest PDL launch's twin with the trigger after its loop (one more timing; the times
        # are agreed, so every rank times the same twin).
        pdl = [name for name in times if methods[name].late_twin() is not None]
        twin = methods[min(pdl, key=times.__getitem__)].late_twin() if pdl else None
        if twin is not None:
            elapsed = (math.inf if str(twin) in choice.rejected else
                       _time_method(twin, label, rows, x, operands, timed, dtype, measure, choice.rejected, with_norm))
            if reduce_across_ranks is not None:
                elapsed = reduce_across_ranks([elapsed])[0]
            if math.isfinite(elapsed):
                times[str(twin)], methods[str(twin)] = elapsed, twin
        choice.times[rows] = times
        choice.chosen[rows] = methods[_fastest(_preferred(times, methods, rows, operands[0]), methods)]
        unbounded = {n: (m, times[n]) for n, m in methods.items() if m.max_rows is None and n in times}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    choice.beyond = unbounded[_fastest({n: t for n, (_, t) in unbounded.items()},
                                       {n: m for n, (m, _) in unbounded.items()})][0]
    return choice


def _time_method(method: Method, label: str, rows: int, x: torch.Tensor, operands: Sequence[LinearOperands],
                 timed: list[LinearOperands], dtype: torch.dtype, measure: Measure, rejected: dict[str, str],
                 with_norm: bool = False) -> float:
    """A candidate's ms per call at this row count, once its product is checked; inf (and the
    reason in `rejected`) where it cannot run here, so it is never chosen."""
    name = str(method)
    runners = None
    try:
        runners = [method.bind(op, dtype) for op in timed]
        error = relative_error(runners[0], operands[0], x)
        tolerance = ACTIVATION_QUANT_TOLERANCE if isinstance(method, (Fp8Gemm, Fp8Cublas)) else TOLERANCE
        if not error <= tolerance:
            raise ValueError(f"relative error {error:.3g} > {tolerance}")
        return measure(method, as_fed(runners, operands[0], x, with_norm), x)
    except Exception as exc:   # noqa: BLE001 - a candidate that cannot run here is not chosen
        rejected[name] = f"{type(exc).__name__}: {exc}"[:300]
        logger.info("linear %s: %s rejected at %d rows (%s)", label, name, rows, rejected[name])
        return math.inf
    finally:
        del runners


def _preferred(times: dict[str, float], methods: dict[str, Method], rows: int,
               operands: LinearOperands) -> dict[str, float]:
    """The times the choice is made among: up to WHOLE_SLICE_ROWS rows, for 16-bit weights of at most
    WHOLE_SLICE_MAX_BYTES (FP8 weights: WHOLE_SLICE_FP8_MAX_BYTES), those of the whole-slice GEMVs where any
    ran; else all of them."""
    weight = operands.weight
    bound = WHOLE_SLICE_FP8_MAX_BYTES if operands.fp8 else WHOLE_SLICE_MAX_BYTES
    if rows <= WHOLE_SLICE_ROWS and weight.numel() * weight.element_size() <= bound:
        whole = {name: t for name, t in times.items()
                 if isinstance(methods[name], Gemv) and whole_slice(methods[name].config, weight.shape[1])}
        if whole:
            return whole
    return times


def _fastest(times: dict[str, float], methods: dict[str, Method]) -> str:
    """The quickest method; a bf16 copy of FP8 weights only with DEQUANTIZED_MARGIN to spare."""
    def cost(name: str) -> float:
        return times[name] / DEQUANTIZED_MARGIN if methods[name].extra_weight_bytes else times[name]
    return min(times, key=cost)   # min keeps the first of equals: the candidates' order


def bind_plan(choice: KindChoice, operands: LinearOperands, dtype: torch.dtype) -> LinearPlan:
    """A plan for one layer of the kind: each distinct chosen method bound once."""
    bound: dict[str, Runner] = {}

    def runner(method: Method) -> Runner:
        if str(method) not in bound:
            bound[str(method)] = method.bind(operands, dtype)
        return bound[str(method)]

    bounds = list(choice.chosen)
    return LinearPlan(bounds, [runner(choice.chosen[b]) for b in bounds], runner(choice.beyond))


def linear_kinds(model: nn.Module) -> dict[tuple, tuple[str, list[nn.Module]]]:
    """The model's planned linear layers grouped by kind: (name, shape, format) -> (label, layers)."""
    from worker_svc.layers.embed_head import ParallelLMHead
    from worker_svc.layers.linear import _ParallelLinear

    kinds: dict[tuple, tuple[str, list[nn.Module]]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (_ParallelLinear, ParallelLMHead)):
            continue
        operands = module.operands()
        kind = name.rsplit(".", 1)[-1]
        num_cols, width = operands.weight.shape
        key = (kind, num_cols, width, operands.block, operands.silu_mul, operands.norm_fed, operands.weight.dtype)
        weight_format = "fp8" if operands.fp8 else str(operands.weight.dtype).removeprefix("torch.")
        label = f"{kind} {num_cols}x{width} {weight_format}"
        kinds.setdefault(key, (label, []))[1].append(module)
    return kinds


def select_linear_methods(model: nn.Module, device: torch.device, dtype: torch.dtype, *, max_rows: int,
                          measure: Measure = graph_time, reduce_across_ranks: Reduce | None = None
                          ) -> dict[str, KindChoice]:
    """Chooses and installs every planned linear layer's methods (see the module docstring);
    returns the choices by kind. Nothing on the CPU or with WORKER_LINEAR_KERNELS=0."""
    device = torch.device(device)
    if device.type != "cuda" or not ENABLED:
        return {}
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    choices = {}
    kinds = linear_kinds(model).values()
    first_layers = [layers[0].operands() for _, layers in kinds]   # one layer's operands of each kind
    with torch.inference_mode():
        _check_fp8_fusion(first_layers, device, dtype)
        pdl = pdl_in_graphs(device)
        candidate_methods = functools.partial(candidates, pdl=pdl)
        started = time.perf_counter()
        try:
            failed = precompile(first_layers, dtype, device, max_rows=max_rows,
                                sms=sms, candidate_methods=candidate_methods)
            logger.info("linear candidates compiled in %.1f s (%d failed)", time.perf_counter() - started, failed)
        except Exception as exc:  # noqa: BLE001 - the measurement below compiles them one by one instead
            logger.warning("compiling the linear candidates in parallel failed (%s); they compile one by one", exc)
        if not pdl:
            logger.info("programmatic dependent launch does not replay in CUDA graphs here: GEMVs launch without it")
        for label, layers in kinds:
            operands = [layer.operands() for layer in layers]
            choice = choose_methods(label, operands, dtype, device, max_rows=max_rows, sms=sms, measure=measure,
                                    candidate_methods=candidate_methods, reduce_across_ranks=reduce_across_ranks)
            for layer, op in zip(layers, operands, strict=True):
                layer.plan = bind_plan(choice, op, dtype)
            choices[label] = choice
            logger.info("linear %s (%d layers), ms per call by rows: %s", label, len(layers), choice.summary())
            logger.debug("linear %s, every candidate's ms per call by rows: %s", label, choice.table())
    torch.cuda.empty_cache()
    return choices
