"""Attention-splits stage: the bfloat16 decode launch at small batches, the split-K factor and the
launch config swept (PERF_NOTES v40). At one row Qwen3-0.6B's attention takes ~9.6 us a layer for
~1 us of KV bytes (v39's profile); the default splits a 1 x 1024 decode 64 ways (decode_num_splits
fills the GPU by the batch shape alone, as a captured graph must), so 48 of the 64 splits of each kv
head find no keys, and the last split merges 64 partials. This sweep says what each split factor
and config costs at 1/4/16/64 x 1024 (and 1 x 4096), each a CUDA-graph replay (triton's do_bench
median, L2 flushed), with the error against the torch reference for each; and the default launch
with its programs handed out longest context first (AttentionMetadata.decode_order), on a batch of
256 contexts of 100-2048 tokens as the service's large batches hold. --kv fp8 sweeps the FP8 cache's
decode kernel instead; --heads-first adds each launch with its grid's kv heads first and not, the
default launch both ways (PERF_NOTES v44).

    python -m bench.stages.attention_splits --out DIR          # H200: ~2 min, DIR/attention_splits.json
    python -m bench.stages.attention_splits --out DIR --device cpu   # tiny shapes, Triton's interpreter
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import random
import sys
import time
from dataclasses import asdict

import torch

from bench.stages.attention import CPU, FLOOR_BANDWIDTH, GPU, kv_bytes, relative_error, shape_of, timer

STAGE = "attention_splits"
GPU_CASES = tuple((f"decode {b}x{c}", ((c - 1, 1),) * b) for b, c in ((1, 1024), (4, 1024), (16, 1024), (64, 1024), (256, 1024),
                                                                       (1, 4096))) + (
    # The service's large batches hold contexts of 100-2048 tokens (bench.py's workload): one program
    # per (request, kv head) unsplit, the longest ones end the launch alone.
    ("decode 256 ragged", tuple((c - 1, 1) for c in random.Random(0).choices(range(100, 2049), k=256))),
    ("decode 64 ragged", tuple((c - 1, 1) for c in random.Random(1).choices(range(100, 2049), k=64))),
    ("decode 16 ragged", tuple((c - 1, 1) for c in random.Random(2).choices(range(100, 2049), k=16))),
    # Short contexts at large batches (the in-process decode stages' prompt 32 + 128 steps): a program's
    # two 64-key tiles, so its fixed cost weighs (v42: Qwen3-8B's attention there at 67% of the copy rate).
    ("decode 64x128", ((127, 1),) * 64), ("decode 256x128", ((127, 1),) * 256))
CPU_CASES = tuple((f"decode {b}x{c}", ((c - 1, 1),) * b) for b, c in ((1, 64), (3, 32)))
GPU_SPLITS = (2, 4, 8, 16, 32, 64)
CPU_SPLITS = (1, 2, 4)
# (kernel, kv_tile, num_warps, num_stages): the tile kernel's default first, then the decode kernel's.
GPU_CONFIGS = (("tiles", 64, 4, 3), ("tiles", 128, 4, 3), ("tiles", 32, 4, 2), ("tiles", 64, 4, 2),
               ("gqa", 32, 2, 1), ("gqa", 64, 2, 1), ("gqa", 32, 4, 2), ("gqa", 64, 4, 2))
CPU_CONFIGS = (("tiles", 16, 4, 1), ("gqa", 16, 1, 1))
# Over an FP8 cache (--kv fp8): the decode kernel's configs (triton_kernels.DECODE_LAUNCHES_FP8_GQA's first).
GPU_CONFIGS_FP8 = (("gqa", 32, 1, 2), ("gqa", 32, 2, 1), ("gqa", 64, 2, 1), ("gqa", 32, 4, 2), ("gqa", 64, 4, 2),
                   ("gqa", 64, 1, 2), ("tiles", 128, 4, 3))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=pathlib.Path, help="folder for attention_splits.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cases", default="", help="only the cases whose names contain this")
    p.add_argument("--splits", default="", help="split factors to sweep, comma-separated (default: the table's)")
    p.add_argument("--configs", type=int, default=0, help="only the first N launch configs (default: all)")
    p.add_argument("--heads", default="", help="query and kv heads, e.g. 32,8 for Qwen3-8B (default: Qwen3-0.6B's 16,8)")
    p.add_argument("--kv", default="bf16", choices=["bf16", "fp8"], help="the KV cache's type (fp8: the decode kernel's "
                   "configs are swept)")
    p.add_argument("--longest", action="store_true", help="the swept launches longest context first too (the default "
                   "launch is timed both ways regardless)")
    p.add_argument("--heads-first", action="store_true",
                   help="each swept config also with its grid's kv heads first (LaunchConfig.heads_first)")
    return p.parse_args(argv)


@torch.inference_mode()
def sweep(device: torch.device, only: str = "", split_list: str = "", num_configs: int = 0,
          heads: str = "", kv: str = "bf16", heads_first: bool = False, longest: bool = False) -> list[dict]:
    """A row per (case, launch): the default launch (its config and split factor from the tables),
    it longest first, with heads_first each of them in the grid's other order too, then each config
    at each split factor (and in both orders)."""
    from worker_svc.layers.attention import triton_kernels as tk
    from worker_svc.layers.attention.base import longest_first_order
    from worker_svc.layers.attention.kv_quant import FP8_KV_DTYPE
    from worker_svc.layers.attention.selection import synthetic_kv_scales, synthetic_step
    from worker_svc.layers.attention.torch_backend import TorchAttentionBackend

    gpu = device.type == "cuda"
    setup = GPU if gpu else CPU
    if heads:
        num_heads, num_kv_heads = (int(n) for n in heads.split(","))
        setup = dataclasses.replace(setup, num_heads=num_heads, num_kv_heads=num_kv_heads)
    fp8 = kv == "fp8"
    cases, splits, configs = (GPU_CASES, GPU_SPLITS, GPU_CONFIGS_FP8 if fp8 else GPU_CONFIGS) if gpu \
        else (CPU_CASES, CPU_SPLITS, CPU_CONFIGS)
    cases = [(name, requests) for name, requests in cases if only in name]
    splits = tuple(int(n) for n in split_list.split(",")) if split_list else splits
    configs = configs[:num_configs or None]
    cache_dtype = FP8_KV_DTYPE if fp8 else setup.dtype
    shape = shape_of(setup, cache_dtype)
    kv_scales = synthetic_kv_scales(shape, device) if fp8 else None
    orders = (False, True) if heads_first else (tk.DECODE_HEADS_FIRST,)
    time_ms, scale, rows = timer(device), setup.head_dim ** -0.5, []
    for seed, (name, requests) in enumerate(cases):
        q, _, _, k_cache, v_cache, meta = synthetic_step(requests, shape, device, seed=seed)
        ref = TorchAttentionBackend().attend(q.float(), k_cache, v_cache, meta, scale, kv_scales)
        floor_ms = kv_bytes(requests, setup, cache_dtype) / FLOOR_BANDWIDTH * 1e3
        default = tk.decode_launch(fp8, len(requests))
        default_splits = tk.decode_num_splits(len(requests), setup.num_kv_heads, device, default.num_warps)
        launches = [("default", default, default_splits), ("longest first", default, default_splits)]
        if heads_first:   # the default launch in the grid's other order
            other = dataclasses.replace(default, heads_first=not default.heads_first)
            name_other = "heads first" if other.heads_first else "requests first"
            launches += [(name_other, other, default_splits), (f"longest first, {name_other}", other, default_splits)]
        launches += [("swept", tk.LaunchConfig(16, kv_tile, w, st, kernel, heads_first=h), n)
                     for kernel, kv_tile, w, st in configs for h in orders for n in splits]
        for label, launch, num_splits in launches:
            row = dict(case=name, label=label, floor_ms=floor_ms, num_splits=num_splits, **asdict(launch))

            # Longest first: the order AttentionMetadata.decode_order takes (sorted once a step, not timed here).
            order = longest_first_order(meta.seq_lens) if label.startswith("longest first") or (
                longest and label == "swept") else None

            def call(q=q, k=k_cache, v=v_cache, m=meta, launch=launch, n=num_splits, order=order):
                return tk.paged_attention(q, k, v, m.query_start_loc, m.seq_lens, m.block_tables, scale,
                                          pure_decode=True, num_splits=n, launch=launch, decode_order=order,
                                          kv_scales=kv_scales)
            try:
                row["err"] = relative_error(call(), ref)
                row["ms"] = time_ms(call)
            except Exception as exc:   # a config that does not compile or fit: recorded, the rest go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
        print(f"# swept {name}", flush=True)
        del q, k_cache, v_cache, meta, ref
        if gpu:
            torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'case':18s} {'default ms':>10s} {'best ms':>8s} {'best/def':>8s} {'floor':>7s}  best launch (err); "
          "runners-up")
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case and "ms" in r and r["err"] < 2e-2]
        default = next((r for r in mine if r["label"] == "default"), None)
        ranked = sorted((r for r in mine if r["label"] in ("swept", "default")), key=lambda r: r["ms"])
        if not ranked or default is None:
            print(f"{case:18s} no result")
            continue
        best = ranked[0]
        label = lambda r: (f"{r['kernel']} kv{r['kv_tile']} w{r['num_warps']} s{r['num_stages']} split{r['num_splits']}"  # noqa: E731
                           + (" hf" if r.get("heads_first") else ""))
        for ordered in (r for r in mine if r["label"] not in ("swept", "default")):   # the default launch reordered
            print(f"{case:18s} {ordered['label']} {ordered['ms']:.4f} ms: {ordered['ms'] / default['ms']:.3f}x the "
                  f"default (err {ordered['err']:.1e})")
        print(f"{case:18s} {default['ms']:10.4f} {best['ms']:8.4f} {best['ms'] / default['ms']:8.2f} "
              f"{best['floor_ms']:7.4f}  {label(best)} ({best['err']:.1e}); "
              + ", ".join(f"{label(r)} {r['ms']:.4f}" for r in ranked[1:5])
              + f"  [default {label(default)}]")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if args.device == "cpu":   # Triton's interpreter, patched to compute as a GPU does
        from tools.triton_interpreter import gpu_faithful
    else:
        gpu_faithful = contextlib.nullcontext
    with gpu_faithful():
        rows = sweep(torch.device(args.device), args.cases, args.splits, args.configs, args.heads, args.kv,
                     args.heads_first, args.longest)
    result = dict(ok=True, result=dict(rows=rows), wall_s=time.time() - started)
    (args.out / f"{STAGE}.json").write_text(json.dumps(result, indent=1))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
