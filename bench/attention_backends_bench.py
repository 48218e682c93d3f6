"""Per-layer attention time of each backend that runs here (triton, flash_attn; torch only where
it is not absurdly slow) on Qwen3-0.6B's attention (16 query heads, 8 kv heads, head_dim 128,
bf16), beside each case's bandwidth floor, with the error against the torch backend; then the
host cost of each backend's Python call, to tell where a backend loses to its launch overhead
and where to its kernel. One command, a short table, every number also in --out (JSON).

Cases, each at block size 16 (the worker's default) and 128 (FlashAttention-4's key tile for
head_dim 128, where it loads pages by TMA): decode of 1, 64 and 256 requests at context 1k, 4k
and 16k, timed eagerly and as a CUDA-graph replay (how the worker runs decode); prompts of
4 x 1k and 1 x 8k tokens; a mixed step (a 512-token chunk over 1k cached tokens beside 255
decodes), eagerly (how the worker runs them). Every request owns distinct blocks in random
order. GPU timing: triton.testing.do_bench medians, L2 flushed before each call. Floor: the K/V
bytes a step must read over the measured copy bandwidth (read + write bytes per second of a
2 GiB device copy); prompts are compute-bound, so TFLOP/s of causal attention is beside it.

Host cost: CPU microseconds per call on a one-token decode (the store kernel's launch, then the
attention call), and that decode's time eager vs replayed from a CUDA graph.

    python -m bench.attention_backends_bench --out /tmp/attention.json              # H200: < 4 min
    python -m bench.attention_backends_bench --device cpu --out /tmp/attention.json # tiny shapes, smoke test

On the CPU the shapes are tiny, the dtype float32, and Triton runs under its interpreter.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from bench.stages.attention import Heads


@dataclass(frozen=True)
class Setup(Heads):
    block_sizes: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prompts: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]
    torch_max_requests: int   # the torch backend (one SDPA per request) is timed up to this batch


GPU = Setup(16, 8, 128, torch.bfloat16, (16, 128), (1, 64, 256), (1024, 4096, 16384),
            (("prompt 4x1k", ((0, 1024),) * 4), ("prompt 1x8k", ((0, 8192),)),
             ("mixed 512/1k+255 dec", ((1024, 512),) + ((1024, 1),) * 255)), torch_max_requests=4)
CPU = Setup(4, 2, 32, torch.float32, (16, 32), (1, 4), (32, 96),
            (("prompt 2x32", ((0, 32),) * 2), ("prompt 1x64", ((0, 64),)),
             ("mixed 16/32+3 dec", ((32, 16),) + ((32, 1),) * 3)), torch_max_requests=1 << 30)
BACKENDS = ("torch", "triton", "flash_attn")
HOST_CALLS = 200


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", required=True, help="JSON with every row")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of " + ",".join(BACKENDS))
    return p.parse_args(argv)


def shape_for(setup: Setup, block_size: int):
    from worker_svc.layers.attention.selection import AttentionShape

    return AttentionShape(num_heads=setup.num_heads, num_kv_heads=setup.num_kv_heads, head_dim=setup.head_dim,
                          dtype=setup.dtype, block_size=block_size, max_num_seqs=256, max_num_batched_tokens=16384,
                          max_model_len=32768)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large copy (2 GiB on a GPU)."""
    size = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer(device)(functools.partial(dst.copy_, src))
    return 2 * size / (ms * 1e-3)


def timer(device: torch.device):
    """ms per call: do_bench's median with L2 flushed on a GPU, the wall clock on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    from worker_svc.layers.attention.selection import time_per_call

    return lambda fn: time_per_call(fn, device, calls=2, rounds=3)


def load_backends(names: list[str], device: torch.device) -> dict:
    from worker_svc.layers.attention.registry import describe_error, get_attention_backend, load_backend

    found = {}
    for name in names:
        try:
            if device.type == "cpu" and name == "triton":   # the interpreter (main() patches it like a GPU)
                found[name] = load_backend(name)
            else:
                found[name] = get_attention_backend(name, device)
        except Exception as exc:
            print(f"# {name} skipped: {describe_error(exc)}", flush=True)
    return found


def kv_bytes(requests, setup: Setup) -> int:
    return sum(c + n for c, n in requests) * setup.num_kv_heads * setup.head_dim * setup.dtype.itemsize * 2


def attention_flops(requests, setup: Setup) -> int:
    visible = sum(c * n + n * (n + 1) // 2 for c, n in requests)
    return 4 * visible * setup.head_dim * setup.num_heads


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def graph_of(fn):
    """A CUDA graph of fn (already run once eagerly, so nothing compiles during capture)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def cases(setup: Setup) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    decodes = [(f"decode b={b} ctx={c}", ((c - 1, 1),) * b)
               for b in setup.decode_batches for c in setup.decode_contexts]
    return decodes + list(setup.prompts)


@torch.inference_mode()
def run_cases(setup: Setup, backends: dict, device: torch.device, bandwidth: float) -> list[dict]:
    from worker_svc.layers.attention.selection import run_step, synthetic_step

    time_ms = timer(device)
    scale = setup.head_dim ** -0.5
    rows = []
    for block_size in setup.block_sizes:
        shape = shape_for(setup, block_size)
        for seed, (name, requests) in enumerate(cases(setup)):
            step = synthetic_step(requests, shape, device, seed=seed)
            pure_decode = all(n == 1 for _, n in requests)
            reference = run_step(backends["torch"], step, scale) if "torch" in backends else None
            for backend_name, backend in backends.items():
                row = dict(case=name, block_size=block_size, backend=backend_name,
                           floor_ms=kv_bytes(requests, setup) / bandwidth * 1e3)
                if backend_name == "torch" and len(requests) > setup.torch_max_requests:
                    continue
                try:
                    call = functools.partial(run_step, backend, step, scale)
                    out = call()   # compiles, outside any timing
                    row["err"] = relative_error(out, reference) if reference is not None else math.nan
                    row["eager_ms"] = time_ms(call)
                    if pure_decode and device.type == "cuda" and getattr(backend, "supports_cuda_graphs", False):
                        graph = graph_of(call)
                        row["graph_ms"] = time_ms(graph.replay)
                        del graph
                except Exception as exc:  # one failing backend must not hide the others' rows
                    row["error"] = repr(exc)[:300]
                    print(f"# {name} block {block_size} {backend_name}: FAILED {row['error']}", flush=True)
                served_ms = row.get("graph_ms", row.get("eager_ms"))
                if served_ms:
                    row["floor_pct"] = 100 * row["floor_ms"] / served_ms
                    row["tflops"] = attention_flops(requests, setup) / (served_ms * 1e-3) / 1e12
                rows.append(row)
                print(json.dumps(row), flush=True)
            del step, reference, call
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def host_costs(setup: Setup, backends: dict, device: torch.device) -> list[dict]:
    """CPU time of each backend's call on a one-token decode, split into the K/V store's launch
    and the rest; and that decode eager vs from a CUDA graph (the difference is launch cost)."""
    from worker_svc.layers.attention.selection import run_step, synthetic_step

    time_ms = timer(device)
    block_size = setup.block_sizes[0]
    step = synthetic_step(((block_size - 1, 1),), shape_for(setup, block_size), device, seed=7)
    q, k, v, k_cache, v_cache, meta = step
    scale = setup.head_dim ** -0.5
    rows = []
    for name, backend in backends.items():
        if name == "torch" and device.type == "cuda":
            continue
        row = dict(backend=name)
        store = _store_call(name, step)
        call = functools.partial(run_step, backend, step, scale)
        row["total_host_us"] = host_us(call, device)
        row["store_host_us"] = host_us(store, device) if store else 0.0
        row["attention_host_us"] = row["total_host_us"] - row["store_host_us"]
        row["eager_ms"] = time_ms(call)
        if device.type == "cuda" and getattr(backend, "supports_cuda_graphs", False):
            graph = graph_of(call)
            row["graph_ms"] = time_ms(graph.replay)
            del graph
        rows.append(row)
        print(json.dumps(row), flush=True)
    del q, k, v, k_cache, v_cache, meta
    return rows


def _store_call(backend_name: str, step):
    """The K/V store as the backend launches it (Triton's kernel for triton and flash_attn)."""
    q, k, v, k_cache, v_cache, meta = step
    if backend_name == "torch":
        from worker_svc.layers.attention.torch_backend import write_kv_cache

        return lambda: write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    from worker_svc.layers.attention.triton_kernels import store_kv_cache

    return lambda: store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)


def host_us(fn, device: torch.device) -> float:
    """Microseconds of CPU per call, the calls issued back to back (a tiny problem, so the
    device keeps up and the host is what is measured)."""
    calls = HOST_CALLS if device.type == "cuda" else 3   # the interpreter takes a second a call
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    if device.type == "cuda":
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not math.isnan(value) else "-"


def print_tables(rows: list[dict], host_rows: list[dict], backends: list[str], bandwidth: float) -> None:
    by_key = {(r["case"], r["block_size"], r["backend"]): r for r in rows}
    accelerated = [b for b in backends if b != "torch"]
    print(f"\n## per-layer attention ms (decode: eager / CUDA-graph replay; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s)")
    header = f"{'case':24s} {'blk':>4s} {'floor':>7s}"
    for b in accelerated:
        header += f" {b + ' eager':>16s} {b + ' graph':>16s} {'%floor':>6s} {'err':>7s}"
    header += f" {'torch':>8s}"
    if len(accelerated) == 2:
        header += f" {accelerated[1] + '/' + accelerated[0]:>18s}"
    print(header)
    seen = []
    for r in rows:
        key = (r["case"], r["block_size"])
        if key in seen:
            continue
        seen.append(key)
        line = f"{r['case']:24s} {r['block_size']:4d} {r['floor_ms']:7.3f}"
        served = {}
        for b in accelerated:
            row = by_key.get((*key, b), {})
            served[b] = row.get("graph_ms", row.get("eager_ms", math.nan))
            line += (f" {_fmt(row.get('eager_ms'), '16.3f'):>16s} {_fmt(row.get('graph_ms'), '16.3f'):>16s}"
                     f" {_fmt(row.get('floor_pct'), '6.0f'):>6s} {_fmt(row.get('err'), '7.1e'):>7s}")
        line += f" {_fmt(by_key.get((*key, 'torch'), {}).get('eager_ms'), '8.3f'):>8s}"
        if len(accelerated) == 2:
            line += f" {_fmt(served[accelerated[1]] / served[accelerated[0]], '18.2f'):>18s}"
        print(line)
    print("\n## host cost of one call (one-token decode)")
    print(f"{'backend':12s} {'store us':>9s} {'attn call us':>13s} {'total us':>9s} {'eager ms':>9s} {'graph ms':>9s}")
    for r in host_rows:
        print(f"{r['backend']:12s} {r['store_host_us']:9.1f} {r['attention_host_us']:13.1f} {r['total_host_us']:9.1f} "
              f"{_fmt(r['eager_ms'], '9.4f'):>9s} {_fmt(r.get('graph_ms'), '9.4f'):>9s}")


def why_notes(setup: Setup, backends: dict, device: torch.device) -> list[str]:
    """Facts about the kernels that the table's numbers rest on."""
    notes = []
    if device.type == "cuda" and "flash_attn" in backends:
        major, minor = torch.cuda.get_device_capability(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if major == 9:
            notes.append(f"flash_attn on sm{major}{minor}: FlashAttention-4 has no split-KV on sm90, so a decode "
                         f"runs batch x {setup.num_kv_heads} kv heads CTAs (b=1: {setup.num_kv_heads} CTAs on "
                         f"{sms} SMs; b=64: {64 * setup.num_kv_heads}); each CTA's 128-row query tile holds "
                         f"{setup.num_heads // setup.num_kv_heads} rows of a one-token decode (GQA packed)")
    return notes


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
        from tools.triton_interpreter import gpu_faithful

        with gpu_faithful():
            return measure(args, device)
    if not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 1
    return measure(args, device)


def measure(args: argparse.Namespace, device: torch.device) -> int:
    setup = GPU if device.type == "cuda" else CPU
    started = time.perf_counter()
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    backends = load_backends(names, device)
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    bandwidth = copy_bandwidth(device)
    print(f"# copy bandwidth (read + write): {bandwidth / 1e12:.3f} TB/s", flush=True)
    rows = run_cases(setup, backends, device, bandwidth)
    host_rows = host_costs(setup, backends, device)
    notes = why_notes(setup, backends, device)
    seconds = time.perf_counter() - started
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, copy_bandwidth=bandwidth, backends=list(backends), rows=rows,
                  host=host_rows, notes=notes, seconds=seconds,
                  date=time.strftime("%Y-%m-%d"))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_tables(rows, host_rows, list(backends), bandwidth)
    for note in notes:
        print(f"\n# {note}")
    print(f"\n# {seconds:.0f} s; rows in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
