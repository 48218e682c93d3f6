"""One layer of Qwen3-0.6B attention (16 query heads, 8 kv heads, head_dim 128, bf16, paged cache
of 16-token blocks) through each backend that runs here, against the floor.

Decode is memory-bound: the floor is the KV bytes of every request over the measured copy
bandwidth. Prefill is reported in TFLOP/s of causal attention (4 * visible keys * head_dim per
query head). Triton launch configs can be swept (--sweep) to choose triton_kernels' defaults.
The comparison of backends (eager and CUDA graphs, two block sizes, host cost) is
bench/attention_backends_bench.py.

    python -m bench.attention_microbench [--sweep] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import sys

import torch

from worker_svc.layers.attention.base import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_CASES = [(1, 1024), (1, 8192), (64, 1024), (256, 1024), (256, 4096)]  # (batch, context)
# (name, [(cached tokens, new tokens), ...])
PREFILL_CASES = [
    ("4 prompts x 1024", [(0, 1024)] * 4),
    ("chunk 2048 over 8192", [(8192, 2048)]),
    ("chunk 512 + 255 decodes", [(1024, 512)] + [(1024, 1)] * 255),
]


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    import triton.testing

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    return 2 * (2 << 30) / (ms * 1e-3)


def paged_step(requests: list[tuple[int, int]], seed: int):
    """A step over a random paged cache: (q, k, v, k_cache, v_cache, meta)."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + n for c, n in requests]
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    order = list(range(sum(blocks)))
    rng.shuffle(order)
    table = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
    start, slots = 0, []
    for r, (n_blocks, (cached, new)) in enumerate(zip(blocks, requests)):
        table[r, :n_blocks] = torch.tensor(order[start:start + n_blocks], dtype=torch.int32)
        start += n_blocks
        pos = torch.arange(cached, cached + new)
        slots.append(table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    num_tokens = sum(n for _, n in requests)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    query_lens = [n for _, n in requests]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).cuda(),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=table.cuda(), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
    return q, k, v, k_cache, v_cache, meta


def backends() -> dict:
    from worker_svc.layers.attention import get_attention_backend

    found = {}
    for name in ("torch", "triton", "flash_attn"):
        try:
            found[name] = get_attention_backend(name, "cuda")
        except ValueError as exc:
            print(f"# backend {name} unavailable: {exc}", flush=True)
    return found


def time_backend(backend, step) -> tuple[float, torch.Tensor]:
    import triton.testing

    q, k, v, k_cache, v_cache, meta = step
    scale = HEAD_DIM ** -0.5
    run = lambda: backend.forward(q, k, v, k_cache, v_cache, meta, scale)  # noqa: E731
    out = run()
    ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    return ms, out


def kv_bytes(requests) -> int:
    return sum(c + n for c, n in requests) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize * 2


def attention_flops(requests) -> int:
    visible = sum(c * n + n * (n + 1) // 2 for c, n in requests)
    return 4 * visible * HEAD_DIM * NUM_HEADS


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_cases(found: dict, bandwidth: float, rows: list[dict]) -> None:
    print(f"{'case':30s} {'backend':10s} {'ms':>9s} {'floor ms':>9s} {'GB/s':>7s} {'TFLOP/s':>8s} {'err':>8s}")
    cases = [(f"decode b={b} ctx={c}", [(c - 1, 1)] * b) for b, c in DECODE_CASES] + PREFILL_CASES
    for i, (name, requests) in enumerate(cases):
        step = paged_step(requests, seed=i)
        reference = None
        for backend_name, backend in found.items():
            try:
                ms, out = time_backend(backend, step)
            except Exception as exc:  # one failing backend must not hide the others' rows
                print(f"{name:30s} {backend_name:10s} FAILED: {exc!r}", flush=True)
                continue
            reference = out if reference is None else reference
            row = dict(case=name, backend=backend_name, ms=ms, floor_ms=kv_bytes(requests) / bandwidth * 1e3,
                       gbps=kv_bytes(requests) / (ms * 1e-3) / 1e9,
                       tflops=attention_flops(requests) / (ms * 1e-3) / 1e12, err=rel_err(out, reference))
            rows.append(row)
            print(f"{name:30s} {backend_name:10s} {ms:9.4f} {row['floor_ms']:9.4f} {row['gbps']:7.0f} "
                  f"{row['tflops']:8.2f} {row['err']:8.1e}", flush=True)
        del step


def sweep(rows: list[dict]) -> None:
    """Triton launch configs on the decode and prefill cases; the default config is marked *."""
    from worker_svc.layers.attention import triton_kernels as tk
    from worker_svc.layers.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    variants = {
        "decode": [tk.LaunchConfig(16, kv, w, s) for kv in (32, 64, 128) for w in (4, 8) for s in (2, 3)],
        "prefill": [tk.LaunchConfig(r, kv, w, s) for r in (64, 128) for kv in (32, 64) for w in (4, 8)
                    for s in (2, 3)],
    }
    cases = {"decode": [(f"b={b} ctx={c}", [(c - 1, 1)] * b) for b, c in ((1, 8192), (64, 1024), (256, 1024))],
             "prefill": [(name, reqs) for name, reqs in PREFILL_CASES[:2]]}
    for kind, configs in variants.items():
        print(f"\n{'kind':8s} {'config':34s} " + " ".join(f"{label[:14]:>14s}" for label, _ in cases[kind]))
        default = tk.DECODE_LAUNCH if kind == "decode" else tk.PREFILL_LAUNCH
        steps = [paged_step(reqs, seed=100 + j) for j, (_, reqs) in enumerate(cases[kind])]
        for config in configs:
            setattr(tk, "DECODE_LAUNCH" if kind == "decode" else "PREFILL_LAUNCH", config)
            times = []
            for step in steps:
                try:
                    times.append(time_backend(backend, step)[0])
                except Exception as exc:  # e.g. out of shared memory for a large tile
                    times.append(math.nan)
                    print(f"# {kind} {config}: {exc!r}", flush=True)
            mark = "*" if config == default else " "
            label = f"{mark}rows={config.tile_rows} kv={config.kv_tile} w={config.num_warps} s={config.num_stages}"
            print(f"{kind:8s} {label:34s} " + " ".join(f"{t:14.4f}" for t in times), flush=True)
            rows.append(dict(sweep=kind, config=dataclasses.asdict(config), ms=times))
        setattr(tk, "DECODE_LAUNCH" if kind == "decode" else "PREFILL_LAUNCH", default)
        del steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep Triton launch configs")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    bandwidth = measure_copy_bandwidth()
    print(f"# copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = [dict(copy_bandwidth=bandwidth)]
    run_cases(backends(), bandwidth, rows)
    if args.sweep:
        sweep(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
