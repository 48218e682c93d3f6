"""Attention stage: one Qwen3-0.6B attention layer (16 query heads, 8 kv heads, head_dim 128,
bfloat16, 16-token blocks, Triton backend) over a bfloat16 and an FP8 KV cache.

- Per case (decode 1, 16, 64, 256 requests x 1k context, 256 x 4k, a 4 x 1k prompt, a 512-token
  chunk beside 255 decodes): ms over each cache, each one's floor (the KV bytes the step reads /
  4.25 TB/s), the share of that bandwidth reached, and the relative error against the torch
  reference (float32 attention over the same cache, dequantized). Every step is a CUDA-graph
  replay (the kernels' time, no host), triton's do_bench median with L2 flushed; every request
  owns distinct blocks in random order.
- Attention-side kernels per decoder layer, before the fusions (q/k norm + RoPE, the K/V store,
  attention, the split-K merge) and after (norm + RoPE + store in one kernel; attention merging
  in its last split), counted by torch.profiler, with their graph time.
- A sweep of the FP8 decode launch configs (the tile kernel's and the decode kernel's: tile of
  keys, warps, stages) and of the FP8 tile kernel's prefill/mixed configs (a mixed batch's
  decodes also apart, in the decode kernel): per config ms and error, per case the best against
  the default launch and the bfloat16 cache (what triton_kernels' tables should then say). Their
  kernels (one per config and case) are compiled first by --compile-jobs processes.
- The engine over each cache (Qwen3-0.6B shapes, seeded random weights): the logits error of FP8
  against bfloat16 KV over a prefill, and their greedy first-32-token match rate.

    python -m bench.stages.attention --out DIR --no-engine  # H200: < 3 min; writes DIR/attention.json
    python -m bench.stages.attention --out DIR --device cpu # tiny shapes under Triton's interpreter
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

STAGE = "attention"
FLOOR_BANDWIDTH = 4.25e12   # bytes/s: the H200's measured copy bandwidth (docs/PERF_NOTES.md)
TARGET_CASE, TARGET_SPEEDUP = "decode 256x1024", 1.6


@dataclass(frozen=True)
class Heads:
    """An attention layer's heads and the dtype of its activations."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Setup(Heads):
    block_size: int
    cases: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]   # name, (cached, new) per request
    sweep: tuple[tuple[str, int, int, int], ...]           # FP8 decode: (kernel, kv_tile, num_warps, num_stages)
    prefill_sweep: tuple[tuple[int, int, int, int], ...]   # FP8 tile kernel: (tile_rows, kv_tile, warps, stages)


def _decode(batch: int, context: int) -> tuple[str, tuple[tuple[int, int], ...]]:
    return f"decode {batch}x{context}", ((context - 1, 1),) * batch


GPU = Setup(16, 8, 128, torch.bfloat16, 16, (
    _decode(1, 1024), _decode(16, 1024), _decode(64, 1024), _decode(256, 1024), _decode(256, 4096),
    ("prefill 4x1024", ((0, 1024),) * 4),
    ("mixed 512/1k+255 dec", ((1024, 512),) + ((1023, 1),) * 255),
), sweep=tuple(("tiles",) + c for c in ((32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 4, 4),
                                          (128, 8, 3), (256, 4, 2)))
  + tuple(("gqa", kv, w, st) for kv in (32, 64, 128) for w in (1, 2, 4) for st in (1, 2))
  + (("gqa-fma", 16, 1, 1), ("gqa-fma", 32, 2, 1), ("gqa-fma", 64, 4, 1)),
  prefill_sweep=tuple((r, kv, w, st) for r, kv, w, st in ((64, 64, 4, 3), (64, 32, 4, 3), (64, 128, 4, 3),
                                                          (64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 4, 3),
                                                          (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2))))
CPU = Setup(4, 2, 32, torch.float32, 16, (
    _decode(1, 32), _decode(3, 32), ("mixed 8/16+2 dec", ((16, 8),) + ((15, 1),) * 2),
), sweep=(("tiles", 32, 4, 2), ("gqa", 16, 1, 1), ("gqa", 32, 4, 1), ("gqa-fma", 16, 1, 1)), prefill_sweep=((64, 32, 4, 2), (16, 16, 4, 1)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=pathlib.Path, help="folder for attention.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the FP8 decode launch-config sweep")
    p.add_argument("--no-engine", dest="engine", action="store_false", help="skip the engine's FP8-KV accuracy")
    p.add_argument("--compile-jobs", type=int, default=min(12, os.cpu_count() or 1),
                   help="processes that compile the sweeps' kernels first (1: compile as they run)")
    return p.parse_args(argv)


def shape_of(setup: Setup, cache_dtype: torch.dtype):
    from worker_svc.layers.attention.selection import AttentionShape

    return AttentionShape(setup.num_heads, setup.num_kv_heads, setup.head_dim, setup.dtype, setup.block_size,
                          max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=8192,
                          kv_cache_dtype=cache_dtype)


def kv_bytes(requests, setup: Setup, cache_dtype: torch.dtype) -> int:
    """K and V of every context token, read once."""
    return sum(c + n for c, n in requests) * setup.num_kv_heads * setup.head_dim * 2 * cache_dtype.itemsize


def timer(device: torch.device):
    """ms per call of fn: the replay of a CUDA graph of it on a GPU (do_bench median, L2 flushed),
    the wall clock on the CPU."""
    if device.type != "cuda":
        from worker_svc.layers.attention.selection import time_per_call

        return lambda fn: time_per_call(fn, device, calls=1, rounds=1)
    import triton.testing

    def graph_ms(fn) -> float:
        fn()   # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        try:
            return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
        finally:
            del graph
    return graph_ms


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@torch.inference_mode()
def run_cases(setup: Setup, device: torch.device) -> list[dict]:
    """The main table's rows: each case over each cache."""
    from worker_svc.layers.attention.kv_quant import FP8_KV_DTYPE
    from worker_svc.layers.attention.selection import synthetic_kv_scales, synthetic_step
    from worker_svc.layers.attention.torch_backend import TorchAttentionBackend
    from worker_svc.layers.attention.triton_backend import TritonAttentionBackend

    time_ms, triton, reference = timer(device), TritonAttentionBackend(), TorchAttentionBackend()
    scale = setup.head_dim ** -0.5
    rows = []
    for seed, (name, requests) in enumerate(setup.cases):
        for cache_dtype in (setup.dtype, FP8_KV_DTYPE):
            shape = shape_of(setup, cache_dtype)
            q, _, _, k_cache, v_cache, meta = synthetic_step(requests, shape, device, seed=seed)
            kv_scales = synthetic_kv_scales(shape, device)
            row = dict(case=name, kv=str(cache_dtype).removeprefix("torch."),
                       floor_ms=kv_bytes(requests, setup, cache_dtype) / FLOOR_BANDWIDTH * 1e3)
            try:
                out = triton.attend(q, k_cache, v_cache, meta, scale, kv_scales)
                row["err"] = relative_error(out, reference.attend(q.float(), k_cache, v_cache, meta, scale, kv_scales))
                row["ms"] = time_ms(lambda q=q, k=k_cache, v=v_cache, m=meta, s=kv_scales: triton.attend(
                    q, k, v, m, scale, s))
                row["pct_bandwidth"] = 100 * row["floor_ms"] / row["ms"]
            except Exception as exc:   # one failing case must not hide the others
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k_cache, v_cache, meta
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _layer_inputs(setup: Setup, requests, cache_dtype: torch.dtype, device: torch.device, seed: int):
    """What one decoder layer's attention side starts from: the packed qkv projection, the q/k
    norm weights, cos/sin rows, and the step (cache, metadata, scales)."""
    from worker_svc.layers.attention.selection import synthetic_kv_scales, synthetic_step

    shape = shape_of(setup, cache_dtype)
    _, _, _, k_cache, v_cache, meta = synthetic_step(requests, shape, device, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed)
    num_tokens = meta.slot_mapping.shape[0]
    width = (setup.num_heads + 2 * setup.num_kv_heads) * setup.head_dim
    qkv = torch.randn(num_tokens, width, generator=g, device=device, dtype=setup.dtype)
    weights = [torch.rand(setup.head_dim, generator=g, device=device, dtype=setup.dtype) + 0.5 for _ in range(2)]
    angles = torch.rand(num_tokens, setup.head_dim // 2, generator=g, device=device) * 100
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return qkv, weights, cos_sin, k_cache, v_cache, meta, synthetic_kv_scales(shape, device)


def attention_side(setup: Setup, inputs, fused: bool):
    """One layer's attention side as the model ran it before the fusions, or as it runs now."""
    from worker_svc.layers import fused_kernels
    from worker_svc.layers.attention import qkv_store, triton_kernels as tk

    qkv, (q_weight, k_weight), cos_sin, k_cache, v_cache, meta, kv_scales = inputs
    heads, kv_heads, dim = setup.num_heads, setup.num_kv_heads, setup.head_dim
    scale = dim ** -0.5

    def run():
        if fused:
            q = qkv_store.qk_norm_rope_store(qkv, q_weight, k_weight, 1e-6, 1e-6, cos_sin, heads, kv_heads,
                                             k_cache, v_cache, meta.slot_mapping, kv_scales)
        else:
            fused_kernels.qk_norm_rope_(qkv, q_weight, k_weight, 1e-6, 1e-6, cos_sin, heads, kv_heads)
            q, k, v = (part.view(-1, n, dim) for part, n in
                       zip(qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1), (heads, kv_heads, kv_heads)))
            tk.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        return tk.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                                  pure_decode=meta.is_pure_decode, kv_scales=kv_scales, fused_merge=fused)
    return run


def count_kernels(fn) -> list[str]:
    """Names of the GPU kernels one call of fn launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


@torch.inference_mode()
def kernels_per_layer(setup: Setup, device: torch.device) -> list[dict]:
    """Before/after the fusions: kernels of one layer's attention side, and their time."""
    from worker_svc.layers.attention.kv_quant import FP8_KV_DTYPE

    if device.type != "cuda":
        return []
    time_ms = timer(device)
    rows = []
    steps = [c for c in setup.cases if c[0] in ("decode 1x1024", "decode 16x1024", "decode 256x1024", "prefill 4x1024")]
    for seed, (name, requests) in enumerate(steps):
        for cache_dtype in (setup.dtype, FP8_KV_DTYPE):
            inputs = _layer_inputs(setup, requests, cache_dtype, device, seed)
            row = dict(case=name, kv=str(cache_dtype).removeprefix("torch."))
            for label, fused in (("before", False), ("after", True)):
                fn = attention_side(setup, inputs, fused)
                names = count_kernels(fn)
                row[f"{label}_kernels"], row[f"{label}_names"] = len(names), names
                row[f"{label}_ms"] = time_ms(fn)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_names")}), flush=True)
            del inputs
    return rows


def _launch_key(row: dict) -> tuple:
    return (row["kernel"], row["tile_rows"], row["kv_tile"], row["num_warps"], row["num_stages"],
            row.get("decodes_apart", False))


def _time_launches(setup: Setup, device: torch.device, cases, launches, *, pure_decode: bool,
                   compile_only: bool = False) -> list[dict]:
    """ms and error against the torch reference of each (launch, decodes_apart) on each case
    over an FP8 cache; a config that does not compile or fit is recorded as such. compile_only:
    one call of each, for Triton's cache (the rows: only the failed ones)."""
    from worker_svc.layers.attention import triton_kernels as tk
    from worker_svc.layers.attention.kv_quant import FP8_KV_DTYPE
    from worker_svc.layers.attention.selection import synthetic_kv_scales, synthetic_step
    from worker_svc.layers.attention.torch_backend import TorchAttentionBackend

    time_ms = timer(device)
    shape = shape_of(setup, FP8_KV_DTYPE)
    scale = setup.head_dim ** -0.5
    rows = []
    for seed, (name, requests) in enumerate(cases):
        q, _, _, k_cache, v_cache, meta = synthetic_step(requests, shape, device, seed=seed)
        kv_scales = synthetic_kv_scales(shape, device)
        ref = None if compile_only else TorchAttentionBackend().attend(q.float(), k_cache, v_cache, meta, scale,
                                                                        kv_scales)
        for launch, apart in launches(name):
            row = dict(case=name, **asdict(launch), decodes_apart=apart)

            def call(q=q, k=k_cache, v=v_cache, m=meta, s=kv_scales, launch=launch, apart=apart):
                return tk.paged_attention(q, k, v, m.query_start_loc, m.seq_lens, m.block_tables, scale,
                                          pure_decode=pure_decode, kv_scales=s, launch=launch, decodes_apart=apart)
            try:
                if compile_only:
                    call()
                    continue
                row["err"] = relative_error(call(), ref)
                row["ms"] = time_ms(call)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
        if not compile_only:
            print(f"# swept {name}", flush=True)
        del q, k_cache, v_cache, meta, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def decode_launches(setup: Setup, name: str) -> list:
    """(launch, decodes_apart) of the FP8 decode sweep: the tile kernel's and the decode kernel's."""
    from worker_svc.layers.attention import triton_kernels as tk

    return [(tk.LaunchConfig(tile_rows=16, kv_tile=kv, num_warps=w, num_stages=st, kernel=kernel), False)
            for kernel, kv, w, st in setup.sweep]


def prefill_launches(setup: Setup, name: str) -> list:
    """(launch, decodes_apart) of the FP8 tile-kernel sweep; a mixed case also with its decodes
    apart (the decode kernel's table takes them)."""
    from worker_svc.layers.attention import triton_kernels as tk

    configs = [tk.LaunchConfig(tile_rows=r, kv_tile=kv, num_warps=w, num_stages=st)
               for r, kv, w, st in setup.prefill_sweep]
    return [(c, apart) for c in configs for apart in ((False, True) if name.startswith("mixed") else (False,))]


def _sweep_cases(setup: Setup, decode: bool) -> list:
    return [(name, requests) for name, requests in setup.cases if name.startswith("decode") == decode]


@torch.inference_mode()
def sweep_fp8_decode(setup: Setup, device: torch.device) -> list[dict]:
    return _time_launches(setup, device, _sweep_cases(setup, True), lambda name: decode_launches(setup, name),
                          pure_decode=True)


@torch.inference_mode()
def sweep_fp8_prefill(setup: Setup, device: torch.device) -> list[dict]:
    return _time_launches(setup, device, _sweep_cases(setup, False), lambda name: prefill_launches(setup, name),
                          pure_decode=False)


@torch.inference_mode()
def _compile_some(device_type: str, decode: bool, case_index: int, first: int, count: int) -> list[dict]:
    """A compile process's share of the sweeps: configs first.. of one case; the failed ones."""
    setup, device = (GPU if device_type == "cuda" else CPU), torch.device(device_type)
    name, requests = _sweep_cases(setup, decode)[case_index]
    launches = (decode_launches if decode else prefill_launches)(setup, name)[first:first + count]
    return _time_launches(setup, device, [(name, requests)], lambda _: launches, pure_decode=decode,
                          compile_only=True)


def compile_tasks(setup: Setup, device: torch.device, per_task: int = 4) -> list[tuple]:
    """_compile_some's arguments, covering every config of every sweep case once."""
    tasks = []
    for decode in (True, False):
        for index, (name, _) in enumerate(_sweep_cases(setup, decode)):
            total = len((decode_launches if decode else prefill_launches)(setup, name))
            tasks += [(device.type, decode, index, first, per_task) for first in range(0, total, per_task)]
    return tasks


def compile_sweeps(setup: Setup, device: torch.device, jobs: int) -> list[dict]:
    """Compiles every sweep kernel in `jobs` processes (each launch config and case is its own
    kernel: tens of compiles, minutes in one process) into Triton's on-disk cache, where the
    timed runs then find them. Returns the configs that failed (the timed run records them too)."""
    import concurrent.futures
    import multiprocessing

    from bench.stages import attention   # this module by its name, also when run as __main__

    tasks = compile_tasks(setup, device)
    context = multiprocessing.get_context("spawn")
    failed = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for future in concurrent.futures.as_completed([pool.submit(attention._compile_some, *t) for t in tasks]):
            try:
                failed += future.result()
            except Exception as exc:   # a lost process: its configs compile in the timed run
                failed.append(dict(error=f"{type(exc).__name__}: {str(exc)[:200]}"))
    print(f"# compiled the sweeps in {jobs} processes; failed: {len(failed)}", flush=True)
    return failed


def best_launch(sweep_rows: list[dict]) -> dict | None:
    """The config with the least total time relative to each case's best (every case counts
    alike), among those that ran every case."""
    cases = sorted({r["case"] for r in sweep_rows})
    best = {c: min(r["ms"] for r in sweep_rows if r["case"] == c and "ms" in r) for c in cases
            if any("ms" in r for r in sweep_rows if r["case"] == c)}
    scores = {}
    for r in sweep_rows:
        if "ms" in r and r["case"] in best:
            scores.setdefault(_launch_key(r), []).append(r["ms"] / best[r["case"]])
    complete = {k: sum(v) / len(v) for k, v in scores.items() if len(v) == len(best)}
    if not complete:
        return None
    key = min(complete, key=complete.get)
    return dict(zip(("kernel", "tile_rows", "kv_tile", "num_warps", "num_stages", "decodes_apart"), key),
                mean_ratio_to_best=complete[key])


def best_per_case(sweep_rows: list[dict]) -> dict[str, dict]:
    """Each case's fastest row."""
    best: dict[str, dict] = {}
    for r in sweep_rows:
        if "ms" in r and (r["case"] not in best or r["ms"] < best[r["case"]]["ms"]):
            best[r["case"]] = r
    return best


@torch.inference_mode()
def engine_accuracy(device: torch.device, prompts: int = 8, tokens: int = 32) -> dict:
    """The worker's model over each cache, Qwen3-0.6B shapes with seeded random weights (the
    same in both): logits of a prefill (every attention reads its K/V back from the cache), and
    greedy generation through the in-process engine."""
    import random

    from bench.stages.correctness import prefill_metadata
    from bench.model_dirs import write_config_dir
    from common.sampling import SamplingParams
    from tools.offline import LLM
    from worker_svc.config import WorkerConfig
    from worker_svc.model_runner import ModelRunner

    rng = random.Random(7)
    token_prompts = [[rng.randrange(1, 512) for _ in range(rng.randint(64, 256))] for _ in range(prompts)]
    options = dict(device=device.type, load_format="dummy", attention_backend="triton", max_num_seqs=prompts,
                   max_num_batched_tokens=4096, max_model_len=1024, num_kv_blocks=1024)
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config_dir(pathlib.Path(tmp) / "qwen3-0.6b")
        logits, greedy = {}, {}
        for kv in ("auto", "fp8"):
            runner = ModelRunner(WorkerConfig(model=str(model_dir), enforce_eager=True, kv_cache_dtype=kv, **options))
            lens = [len(p) for p in token_prompts]
            meta = prefill_metadata(lens, runner.block_size, runner.device)
            ids = torch.tensor([t for p in token_prompts for t in p], device=runner.device)
            positions = torch.cat([torch.arange(n) for n in lens]).to(runner.device)
            hidden = runner.model(ids, positions, meta)
            logits[kv] = runner.model.compute_logits(hidden, torch.arange(len(ids), device=runner.device)).float()
            del runner, hidden
            llm = LLM(str(model_dir), kv_cache_dtype=kv, **options)
            greedy[kv] = llm.generate(token_prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens))
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["logits_rel_error_fp8_vs_bf16_kv"] = relative_error(logits["fp8"], logits["auto"])
        result["top1_agreement"] = (logits["fp8"].argmax(-1) == logits["auto"].argmax(-1)).float().mean().item()
        same = [[a == b for a, b in zip(x[:tokens], y[:tokens])] for x, y in zip(greedy["fp8"], greedy["auto"])]
        result["greedy_first32_match"] = sum(map(sum, same)) / (tokens * prompts)
        result["greedy_leading_matches"] = [s.index(False) if False in s else tokens for s in same]
    return result


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not math.isnan(value) else "-"


def _config_label(row: dict) -> str:
    label = f"{row['kernel']} rows {row['tile_rows']} kv {row['kv_tile']} w{row['num_warps']} s{row['num_stages']}"
    return label + (" apart" if row.get("decodes_apart") else "")


def print_sweep(result: dict, rows: list[dict], title: str) -> None:
    """ms of each config (a line) on each case (a column); then per case the best config against
    the default launch (the main table's fp8 row) and the bf16 cache's ms."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    best = best_per_case(rows)
    print(f"\n## {title}, ms (* = best in its column; E = error > 1e-2 against the reference)")
    print(f"{'config':34s}" + "".join(f" {c.removeprefix('decode '):>10s}" for c in cases))
    for key in dict.fromkeys(_launch_key(r) for r in rows):
        line = f"{_config_label(next(r for r in rows if _launch_key(r) == key)):34s}"
        for c in cases:
            row = next((r for r in rows if r["case"] == c and _launch_key(r) == key), {})
            mark = "E" if row.get("err", 0) > 1e-2 else ("*" if best.get(c) is row else " ")
            line += f" {_fmt(row.get('ms', math.nan), '9.4f') + mark:>10s}"
        print(line)
    print(f"{'case':22s} {'default fp8':>11s} {'best fp8':>9s} {'gain':>6s} {base_label(result) + ' ms':>9s} "
          f"{base_label(result) + '/best':>9s}  best config")
    table = {(r["case"], r["kv"]): r for r in result["cases"]}
    for c in cases:
        default = table.get((c, "float8_e4m3fn"), {}).get("ms", math.nan)
        base = table.get((c, result["model_dtype"]), {}).get("ms", math.nan)
        b = best.get(c, {})
        ms = b.get("ms", math.nan)
        print(f"{c:22s} {_fmt(default, '11.4f'):>11s} {_fmt(ms, '9.4f'):>9s} {_fmt(default / ms, '6.2f'):>6s} "
              f"{_fmt(base, '9.4f'):>9s} {_fmt(base / ms, '9.2f'):>9s}  {_config_label(b) if b else '-'}")


def base_label(result: dict) -> str:
    return {"bfloat16": "bf16"}.get(result["model_dtype"], result["model_dtype"])


def print_tables(result: dict) -> None:
    by_case: dict[str, dict[str, dict]] = {}
    for r in result["cases"]:
        by_case.setdefault(r["case"], {})[r["kv"]] = r
    print(f"\n## one attention layer, ms (CUDA-graph replay); floor = KV bytes / {FLOOR_BANDWIDTH / 1e12:.2f} TB/s")
    base_kv = {"bfloat16": "bf16"}.get(result["model_dtype"], result["model_dtype"])
    print(f"{'case':22s} {base_kv + ' ms':>8s} {'floor':>7s} {'%bw':>5s} {'err':>8s}   {'fp8 ms':>8s} {'floor':>7s} "
          f"{'%bw':>5s} {'err':>8s}   {base_kv + '/fp8':>8s}")
    for case, rows in by_case.items():
        base, fp8 = rows.get(result["model_dtype"], {}), rows.get("float8_e4m3fn", {})
        speedup = base.get("ms", math.nan) / fp8.get("ms", math.nan) if fp8.get("ms") else math.nan
        print(f"{case:22s} {_fmt(base.get('ms'), '8.4f'):>8s} {_fmt(base.get('floor_ms'), '7.4f'):>7s} "
              f"{_fmt(base.get('pct_bandwidth'), '5.0f'):>5s} {_fmt(base.get('err'), '8.1e'):>8s}   "
              f"{_fmt(fp8.get('ms'), '8.4f'):>8s} {_fmt(fp8.get('floor_ms'), '7.4f'):>7s} "
              f"{_fmt(fp8.get('pct_bandwidth'), '5.0f'):>5s} {_fmt(fp8.get('err'), '8.1e'):>8s}   {_fmt(speedup, '8.2f'):>8s}")
        for r in (base, fp8):
            if "error" in r:
                print(f"#   {case} {r['kv']}: FAILED {r['error']}")
    target = by_case.get(TARGET_CASE, {})
    if target.get(result["model_dtype"], {}).get("ms") and target.get("float8_e4m3fn", {}).get("ms"):
        ratio = target[result["model_dtype"]]["ms"] / target["float8_e4m3fn"]["ms"]
        print(f"# target: {TARGET_CASE} with fp8 KV >= {TARGET_SPEEDUP}x bf16 KV: {ratio:.2f}x "
              f"({'met' if ratio >= TARGET_SPEEDUP else 'missed'})")
    if result["kernels"]:
        print("\n## attention side of one decoder layer: kernels and ms, before / after the fusions")
        print(f"{'case':22s} {'kv':14s} {'before':>6s} {'after':>6s} {'before ms':>10s} {'after ms':>10s}")
        for r in result["kernels"]:
            print(f"{r['case']:22s} {r['kv']:14s} {r['before_kernels']:6d} {r['after_kernels']:6d} "
                  f"{r['before_ms']:10.4f} {r['after_ms']:10.4f}")
        first = result["kernels"][0]
        print(f"# before: {', '.join(first['before_names'])}\n# after: {', '.join(first['after_names'])}")
    for key, title in (("sweep", "fp8 decode launch configs"), ("prefill_sweep", "fp8 prefill/mixed launch configs")):
        if result.get(key):
            print_sweep(result, result[key], title)
    if result["best_fp8_decode_launch"]:
        b = result["best_fp8_decode_launch"]
        print(f"# best decode config overall (mean {b['mean_ratio_to_best']:.3f}x of each case's best): "
              f"{_config_label(b)}")
    if result["engine"]:
        e = result["engine"]
        print(f"\n## engine, Qwen3-0.6B shapes, random weights: fp8 vs bf16 KV: logits relative error "
              f"{e['logits_rel_error_fp8_vs_bf16_kv']:.2e}, top-1 agreement {e['top1_agreement']:.3f}, greedy "
              f"first-32 match {e['greedy_first32_match']:.1%} (leading {e['greedy_leading_matches']})")


def run(out: pathlib.Path, *, device: str = "cuda", sweep: bool = True, engine: bool = True,
        compile_jobs: int = 1) -> dict:
    """Runs the stage, writes out/attention.json, prints the tables; returns the result."""
    device = torch.device(device)
    setup = GPU if device.type == "cuda" else CPU
    started = time.perf_counter()
    result: dict = dict(stage=STAGE, date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        model_dtype=str(setup.dtype).removeprefix("torch."), floor_bandwidth=FLOOR_BANDWIDTH)
    sections = (("compile", lambda: compile_sweeps(setup, device, compile_jobs) if sweep and compile_jobs > 1 else None),
                ("cases", lambda: run_cases(setup, device)), ("kernels", lambda: kernels_per_layer(setup, device)),
                ("sweep", lambda: sweep_fp8_decode(setup, device) if sweep else []),
                ("prefill_sweep", lambda: sweep_fp8_prefill(setup, device) if sweep else []),
                ("engine", lambda: engine_accuracy(device) if engine else {}))
    for name, section in sections:
        begin = time.perf_counter()
        result[name] = section()
        result[f"{name}_seconds"] = time.perf_counter() - begin
        print(f"# {name}: {result[f'{name}_seconds']:.0f} s", flush=True)
    result["best_fp8_decode_launch"] = best_launch(result["sweep"])
    result["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STAGE}.json").write_text(json.dumps(result, indent=1))
    print_tables(result)
    print(f"\n# {result['seconds']:.0f} s; rows in {out / f'{STAGE}.json'}")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
    elif not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 1
    run(args.out, device=args.device, sweep=args.sweep, engine=args.engine,
        compile_jobs=args.compile_jobs if args.device == "cuda" else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
