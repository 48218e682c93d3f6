"""Part 1 of the linear stage (bench/stages/linear.py): per model x projection x rows, cuBLAS bf16,
every GEMV launch setting swept, the FP8 paths, the weight floor and the start-up selection's pick,
from one set of measurements; and the sweep's tables.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import time

from bench.options import CONFIGS, REPO

FP8_BLOCK = (128, 128)
TINY_FP8_BLOCK = (32, 32)
# GEMV settings swept (the first H200 run's winners and the new loop beside them):
# (block_n, block_k at one row, num_warps) on CUDA cores (block_k shrinks with the rows);
# (block_n, block_k at one row, num_warps, num_stages) with one accumulator per row (row_acc);
# (block_n, block_k, num_warps, num_stages) on tensor cores; each at split-K 1, auto_split's and
# twice that. SWEEP_VARIANTS: the L2 prefetch and chunked split-K sums, on SWEEP_VARIANT_TILES
# (old loop, row_acc) at auto_split's split, beside the same settings without them.
SWEEP_FMA = ((4, 512, 4), (4, 1024, 4), (8, 256, 4), (8, 512, 4), (16, 512, 8))
SWEEP_ROW_ACC = ((4, 512, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (8, 512, 4, 4),
                 (16, 512, 8, 3))
SWEEP_DOT = ((32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 6), (32, 128, 4, 6), (128, 128, 8, 3))
SWEEP_VARIANT_TILES = (((8, 512, 4, 1), False), ((8, 512, 4, 3), True), ((4, 512, 4, 3), True))
SWEEP_VARIANTS = (dict(prefetch=2), dict(split_chunk=4), dict(prefetch=2, split_chunk=4))
# FP8 GEMM tiles swept with activations quantized on load: up to 64 rows, and past it.
SWEEP_FP8_FEW = ((16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4))
SWEEP_FP8_MANY = ((64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3),
                  (64, 256, 8, 3))
NEAR_BEST = 1.05
L2_MULTIPLE, MAX_COPIES = 4, 64


# --- shapes, rates, timing ------------------------------------------------------------------------

def model_config(args: argparse.Namespace, name: str) -> dict:
    if args.tiny:
        hidden = 64 if name == "0.6b" else 128
        return {"hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                "intermediate_size": 2 * hidden, "vocab_size": 512, "num_hidden_layers": 2}
    return json.loads((REPO / "configs" / CONFIGS[name]).read_text())


def projection_shapes(config: dict, tp: int) -> dict[str, tuple[int, int, bool]]:
    """name -> (output columns N, input width K, SwiGLU on the input) on one of tp ranks."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    return {"qkv": ((heads + 2 * kv) * head_dim // tp, h, False), "o": (h, heads * head_dim // tp, False),
            "gate_up": (2 * inter // tp, h, False), "down": (h, inter // tp, True), "lm_head": (vocab // tp, h, False)}


def measure(method, runners, x) -> float:
    """ms per call: linear_selection's CUDA-graph timing on a GPU, one wall-clock pass elsewhere."""
    if x.device.type == "cuda":
        from worker_svc.layers.linear_selection import graph_time

        return graph_time(method, runners, x)
    start = time.perf_counter()
    for run in runners:
        run(x, None)
    return (time.perf_counter() - start) * 1e3 / len(runners)


def copies_for(num_bytes: int, device: str) -> int:
    """Weight copies to cycle through so that they exceed L2_MULTIPLE L2 caches."""
    import torch

    if not device.startswith("cuda"):
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(MAX_COPIES, math.ceil(L2_MULTIPLE * l2 / num_bytes)))


def fp8_block(width: int) -> tuple[int, int]:
    """The official checkpoints' blocks, or smaller ones for the tiny smoke-test shapes."""
    return FP8_BLOCK if width >= FP8_BLOCK[1] else TINY_FP8_BLOCK


def sweep_gemv_configs(rows: int, num_cols: int, width: int, sms: int, fp8: bool, pdl: bool) -> list:
    """Every GEMV setting swept at this row count (the start-up candidates among them)."""
    from worker_svc.layers.gemv_kernels import DOT_MIN_ROWS, ROW_ACC_MAX_ROWS, GemvConfig, check_config
    from worker_svc.layers.linear_candidates import MAX_SPLIT, MIN_FMA_BLOCK_K, auto_split, gemv_configs

    block_m = 1 << max(0, (rows - 1).bit_length())
    bases = []
    if block_m < DOT_MIN_ROWS:
        bases += [GemvConfig(block_m, n, max(MIN_FMA_BLOCK_K, k // block_m), num_warps=w, num_stages=1, pdl=pdl)
                  for n, k, w in SWEEP_FMA]
    if block_m <= ROW_ACC_MAX_ROWS:
        bases += [GemvConfig(block_m, n, max(MIN_FMA_BLOCK_K, k // block_m), num_warps=w, num_stages=st, pdl=pdl,
                             row_acc=True) for n, k, w, st in SWEEP_ROW_ACC]
    if rows > 1 or fp8:
        bases += [GemvConfig(max(block_m, DOT_MIN_ROWS), n, k, num_warps=w, num_stages=s, pdl=pdl)
                  for n, k, w, s in SWEEP_DOT]
    if fp8:   # FP8 weights taken by their bits too (gemv_kernels' fp8_bits)
        bases += [GemvConfig(**{**base.__dict__, "fp8_bits": True}) for base in bases]
    configs = {}
    for base in bases:
        split = auto_split(num_cols, width, rows, base, sms)
        k_tiles = math.ceil(width / base.block_k)
        for s in {1, split, min(2 * split, MAX_SPLIT, max(1, k_tiles // 2))}:
            config = GemvConfig(**{**base.__dict__, "split_k": s})
            configs[str(config)] = config
    if block_m <= ROW_ACC_MAX_ROWS:
        for (n, k, w, st), row_acc in SWEEP_VARIANT_TILES:
            base = GemvConfig(block_m, n, max(MIN_FMA_BLOCK_K, k // block_m), num_warps=w, num_stages=st, pdl=pdl,
                              row_acc=row_acc)
            base = GemvConfig(**{**base.__dict__, "split_k": auto_split(num_cols, width, rows, base, sms)})
            for variant in SWEEP_VARIANTS:
                if pdl or "prefetch" not in variant:
                    config = GemvConfig(**{**base.__dict__, **variant})
                    configs[str(config)] = config
    for config in gemv_configs(rows, num_cols, width, sms, pdl):
        configs.setdefault(str(config), config)
    usable = []
    for config in configs.values():
        try:
            check_config(config, num_cols, width, fp8_block=fp8_block(width) if fp8 else None)
        except ValueError:
            continue
        usable.append(config)
    return usable


def sweep_methods(operands, rows: int, dtype, sms: int, pdl: bool) -> list:
    """The start-up candidates (linear_candidates.candidates) and every other setting swept."""
    from worker_svc.layers.linear_candidates import GEMV_MAX_ROWS, candidates
    from worker_svc.layers.linear_methods import Fp8Gemm, Gemv

    num_cols, width = operands.weight.shape
    methods = {str(m): m for m in candidates(operands, rows, dtype, sms, pdl)}
    extra = []
    if operands.fp8:
        tiles = SWEEP_FP8_FEW if rows <= GEMV_MAX_ROWS else SWEEP_FP8_MANY
        extra += [Fp8Gemm.of(dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=1 if rows <= GEMV_MAX_ROWS else 8, num_warps=w,
                                  num_stages=s)) for bm, bn, w, s in tiles]
    if rows <= GEMV_MAX_ROWS:
        extra += [Gemv(c) for c in sweep_gemv_configs(rows, num_cols, width, sms, operands.fp8, pdl)]
    for method in extra:
        if method.supports(operands, dtype):
            methods.setdefault(str(method), method)
    return list(methods.values())


def compile_all(operand_sets, rows_list: list[int], dtype, sms: int, pdl: bool) -> None:
    """Every Triton method of the sweep at every row count, compiled in parallel."""
    import torch

    from worker_svc.layers.triton_compile import compile_ahead

    calls = []
    for operands in operand_sets:
        for rows in rows_list:
            x = torch.zeros(rows, operands.input_width, dtype=dtype, device=operands.weight.device)
            calls += [lambda m=m, op=operands, x=x: m.bind(op, dtype)(x, None)
                      for m in sweep_methods(operands, rows, dtype, sms, pdl) if m.compiles]
    started = time.perf_counter()
    failed = compile_ahead(calls)
    print(f"   compiled {len(calls)} variants in {time.perf_counter() - started:.1f} s ({failed} failed)", flush=True)


def projection_weights(num_cols: int, width: int, silu: bool, device: str, dtype, with_fp8: bool):
    """(bf16 operands per copy, FP8 operands per copy or None): one random weight, cloned."""
    import torch

    from worker_svc.layers.fp8 import quantize_blocks
    from worker_svc.layers.linear_methods import LinearOperands

    g = torch.Generator(device=device).manual_seed(num_cols * 7 + width)
    weight = (torch.randn(num_cols, width, generator=g, device=device) * 0.02).to(dtype)
    count = copies_for(weight.numel() * weight.element_size(), device)
    dense = [LinearOperands(weight if i == 0 else weight.clone(), silu_mul=silu) for i in range(count)]
    if not with_fp8:
        return dense, None
    block = fp8_block(width)
    values, scale = quantize_blocks(weight, block)
    count8 = copies_for(values.numel(), device)
    fp8 = [LinearOperands(values.clone(), scale.clone(), block, silu) for _ in range(count8)]
    return dense, fp8


def time_methods(methods, operands, x, dtype) -> tuple[dict[str, float], dict[str, str]]:
    """ms per call of each method over the copies; errors by method for those that fail."""
    from worker_svc.layers.linear_selection import ACTIVATION_QUANT_TOLERANCE, TOLERANCE, relative_error

    times, errors = {}, {}
    for method in methods:
        try:
            runners = [method.bind(op, dtype) for op in operands]
            error = relative_error(runners[0], operands[0], x)
            quantizes = str(method).startswith(("fp8-gemm", "fp8-cublas"))
            if not error <= (ACTIVATION_QUANT_TOLERANCE if quantizes else TOLERANCE):
                raise ValueError(f"relative error {error:.3g}")
            times[str(method)] = measure(method, runners, x)
        except Exception as exc:  # noqa: BLE001 - recorded: the table shows what could not run
            errors[str(method)] = f"{type(exc).__name__}: {exc}"[:200]
        runners = None
    return times, errors


def selection_pick(operands, rows: int, dtype, sms: int, pdl: bool,
                   times: dict[str, float]) -> tuple[str, float] | None:
    """What linear_selection would run at this row count, from these measurements."""
    from worker_svc.layers.linear_candidates import candidates
    from worker_svc.layers.linear_selection import _fastest

    methods = {str(m): m for m in candidates(operands, rows, dtype, sms, pdl)}
    measured = {name: times[name] for name in methods if name in times}
    if not measured:
        return None
    name = _fastest(measured, methods)
    return name, measured[name]


def best(times: dict[str, float], prefix: str) -> tuple[str, float] | None:
    matching = {n: t for n, t in times.items() if n.startswith(prefix)}
    if not matching:
        return None
    name = min(matching, key=matching.get)
    return name, matching[name]


def sweep_projection(args, label: str, shape: tuple[int, int, bool], rows_list: list[int], bandwidth: float,
                     sms: int, pdl: bool) -> list[dict]:
    import torch

    num_cols, width, silu = shape
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    with_fp8 = not label.endswith("lm_head")   # the LM head stays in the model dtype
    dense, fp8 = projection_weights(num_cols, width, silu, args.device, dtype, with_fp8)
    if args.device.startswith("cuda"):
        compile_all([dense[0]] + ([fp8[0]] if fp8 else []), rows_list, dtype, sms, pdl)
    records = []
    g = torch.Generator(device=args.device).manual_seed(1)
    for rows in rows_list:
        x = torch.randn(rows, dense[0].input_width, generator=g, device=args.device).to(dtype)
        methods = sweep_methods(dense[0], rows, dtype, sms, pdl)
        dense_times, dense_errors = time_methods(methods, dense, x, dtype)
        record = {"projection": label, "N": num_cols, "K": width, "rows": rows, "silu_mul": silu,
                  "floor_bf16_ms": num_cols * width * 2 / bandwidth * 1e3, "bf16_times": dense_times,
                  "bf16_errors": dense_errors,
                  "pick_bf16": selection_pick(dense[0], rows, dtype, sms, pdl, dense_times)}
        record.update(_pdl_gain(methods, dense, x, dtype, dense_times))
        if fp8 is not None:
            fp8_times, fp8_errors = time_methods(sweep_methods(fp8[0], rows, dtype, sms, pdl), fp8, x, dtype)
            record.update(fp8_times=fp8_times, fp8_errors=fp8_errors,
                          floor_fp8_ms=num_cols * width * (1 + 4 / math.prod(fp8_block(width))) / bandwidth * 1e3,
                          pick_fp8=selection_pick(fp8[0], rows, dtype, sms, pdl, fp8_times))
        records.append(record)
        print(f"   {label} rows {rows}: {_one_line(record)}", flush=True)
    return records


def _pdl_gain(methods: list, operands, x, dtype, times: dict[str, float]) -> dict:
    """The best GEMV setting measured again without programmatic dependent launch."""
    import dataclasses

    from worker_svc.layers.linear_methods import Gemv

    top = best(times, "gemv")
    if top is None or x.device.type != "cuda":
        return {}
    config = next(m.config for m in methods if str(m) == top[0])
    plain = Gemv(dataclasses.replace(config, pdl=False))
    no_pdl, _ = time_methods([plain], operands, x, dtype)
    return {"gemv_best_without_pdl_ms": no_pdl.get(str(plain))}


def _one_line(r: dict) -> str:
    cublas = r["bf16_times"].get("cublas")
    gemv = best(r["bf16_times"], "gemv")
    parts = [f"cublas {cublas:.4f}" if cublas else "cublas -", f"gemv {gemv[1]:.4f}" if gemv else "gemv -"]
    if "fp8_times" in r:
        wo = best(r["fp8_times"], "gemv")
        parts.append(f"fp8 w-only {wo[1]:.4f}" if wo else "fp8 w-only -")
    return ", ".join(parts) + f", floor {r['floor_bf16_ms']:.4f}"


def run_sweep(args: argparse.Namespace, bandwidth: float, pdl: bool) -> list[dict]:
    """Part 1; GEMVs with programmatic dependent launch where graphs replay it (pdl)."""
    import torch

    sms = torch.cuda.get_device_properties(args.device).multi_processor_count if args.device.startswith("cuda") else 4
    rows_list = [int(r) for r in args.rows.split(",")]
    started = time.perf_counter()
    jobs = [(name, 1) for name in args.models.split(",")]
    jobs += [("8b", int(tp)) for tp in args.tp.split(",") if int(tp) > 1]
    records = []
    for name, tp in jobs:
        for proj, shape in projection_shapes(model_config(args, name), tp).items():
            label = f"{'tiny ' if args.tiny else 'Qwen3-'}{name.upper()}{f' tp{tp}' if tp > 1 else ''} {proj}"
            if time.perf_counter() - started > args.sweep_budget_s:
                print(f"   {label}: skipped (sweep budget of {args.sweep_budget_s:.0f} s spent)", flush=True)
                records.append({"projection": label, "skipped": True})
                continue
            with torch.inference_mode():
                records += sweep_projection(args, label, shape, rows_list, bandwidth, sms, pdl)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return records


def suggested_configs(records: list[dict]) -> dict[str, list[tuple[str, int]]]:
    """Per row count, GEMV settings (split-K left out) by how often they came within NEAR_BEST of
    the best GEMV of a projection: what the start-up candidates should be."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        for key in ("bf16_times", "fp8_times"):
            times = {n: t for n, t in r.get(key, {}).items() if n.startswith("gemv")}
            if not times:
                continue
            fastest = min(times.values())
            near = {_without_split(n) for n, t in times.items() if t <= NEAR_BEST * fastest}
            counts[f"{r['rows']} rows {key.split('_')[0]}"].update(near)
    return {k: c.most_common(6) for k, c in sorted(counts.items())}


GEMV_FAMILIES = ("fma", "rows", "pf", "chunk", "bits", "dot")


def gemv_family(name: str) -> str | None:
    """Which loop or variant a swept GEMV setting is (GEMV_FAMILIES); None for other methods."""
    if not name.startswith("gemv("):
        return None
    tokens = name.removeprefix("gemv(").removesuffix(")").split()
    if "bits" in tokens:
        return "bits"
    if any(t.startswith("pf") for t in tokens):
        return "pf"
    if any(t.startswith("chunk") for t in tokens):
        return "chunk"
    if "rows" in tokens:
        return "rows"
    return "dot" if int(tokens[0].removeprefix("m")) >= 16 else "fma"


def family_bests(records: list[dict]) -> list[dict]:
    """Per projection, row count and weight type: the best time of each GEMV family, side by side."""
    table = []
    for r in records:
        for key in ("bf16_times", "fp8_times"):
            bests: dict[str, float] = {}
            for name, t in r.get(key, {}).items():
                family = gemv_family(name)
                if family is not None and t < bests.get(family, math.inf):
                    bests[family] = t
            if bests:
                table.append({"projection": r["projection"], "rows": r["rows"], "weights": key.split("_")[0],
                              "best": bests})
    return table


def _without_split(name: str) -> str:
    return " ".join(t for t in name.split() if not t.startswith("split"))


def print_sweep(records: list[dict], suggested: dict) -> None:
    """The sweep's tables: a row per projection and row count, the best of each GEMV loop, and
    the settings most often near the best."""
    print("\nlinear layers, ms per call (weights from memory); %bw = floor / time; pick = start-up selection")
    print(f"{'projection':26s} {'N x K':>13s} {'rows':>4s} {'cublas':>7s} {'gemv':>7s} {'fp8 wo':>7s} "
          f"{'fp8x8':>7s} {'floor':>7s} {'fp8 fl':>7s} {'%bw':>4s} {'%bw8':>4s}  pick bf16 | pick fp8 | best gemv")
    for r in records:
        if r.get("skipped"):
            print(f"{r['projection']:26s} skipped")
            continue
        print(_table_row(r))
    print("\nbest GEMV per loop, ms: fma (the previous loop), rows (one accumulator per row), pf (+ L2 "
          "prefetch), chunk (+ chunked split-K sums), dot (tensor cores); new/old = min(rows, pf, chunk) / fma")
    print(f"{'projection':26s} {'rows':>4s} {'w':4s} " + " ".join(f"{f:>7s}" for f in GEMV_FAMILIES)
          + f" {'new/old':>7s}")
    for b in family_bests(records):
        best = b["best"]
        new = min((best[f] for f in ("rows", "pf", "chunk") if f in best), default=None)
        ratio = f"{new / best['fma']:7.2f}" if new and best.get("fma") else f"{'-':>7s}"
        print(f"{b['projection']:26s} {b['rows']:4d} {b['weights']:4s} "
              + " ".join(f"{best[f]:7.4f}" if f in best else f"{'-':>7s}" for f in GEMV_FAMILIES) + f" {ratio}")
    print("\nGEMV settings most often within 5% of the best (per row count; weights bf16 / fp8):")
    for key, common in suggested.items():
        print(f"  {key:14s} " + "; ".join(f"{name} x{count}" for name, count in common))


def _table_row(r: dict) -> str:
    def ms(value):
        return f"{value:7.4f}" if value is not None else f"{'-':>7s}"

    gemv = best(r["bf16_times"], "gemv")
    fp8 = r.get("fp8_times", {})
    wo = best(fp8, "gemv")
    x8 = min((t for n, t in fp8.items() if n.startswith(("fp8-gemm", "fp8-cublas"))), default=None)
    best16 = min([t for t in [r["bf16_times"].get("cublas"), gemv and gemv[1]] if t is not None], default=None)
    best8 = min([t for t in [wo and wo[1], x8] if t is not None], default=None)
    pct = f"{100 * r['floor_bf16_ms'] / best16:4.0f}" if best16 else f"{'-':>4s}"
    pct8 = f"{100 * r['floor_fp8_ms'] / best8:4.0f}" if best8 and "floor_fp8_ms" in r else f"{'-':>4s}"
    pick16 = r["pick_bf16"][0] if r.get("pick_bf16") else "-"
    pick8 = r["pick_fp8"][0] if r.get("pick_fp8") else "-"
    shape = f"{r['N']}x{r['K']}"
    return (f"{r['projection']:26s} {shape:>13s} {r['rows']:4d} {ms(r['bf16_times'].get('cublas'))} "
            f"{ms(gemv and gemv[1])} {ms(wo and wo[1])} {ms(x8)} {ms(r['floor_bf16_ms'])} "
            f"{ms(r.get('floor_fp8_ms'))} {pct} {pct8}  {pick16} | {pick8} | {gemv[0] if gemv else '-'}")
