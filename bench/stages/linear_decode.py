"""Part 2 of the linear stage (bench/stages/linear.py): one Qwen3-8B decode step (forward + LM
head, one CUDA graph; dummy weights, bf16 and FP8) with the start-up linear selection and without
it, and the kernels per decoder layer at the first batch.
"""
from __future__ import annotations

import argparse
import collections
import math
import statistics
import time

from bench.options import CONFIGS, REPO

DECODE_REPLAYS = 20


def decode_model(args: argparse.Namespace, quantization: str | None):
    """Qwen3-8B's config (tiny with --tiny) with dummy weights, on the device, bf16."""
    import torch

    from bench.model_dirs import write_config_dir
    from worker_svc.layers.attention.registry import get_attention_backend
    from worker_svc.loader import init_dummy_weights
    from worker_svc.model_config import load_model_config
    from worker_svc.models import build_model

    model_dir = args.out / "models" / ("tiny-8b" if args.tiny else "qwen3-8b")
    if not (model_dir / "config.json").exists():
        if args.tiny:
            from common.tiny_model import write_tiny_qwen3

            write_tiny_qwen3(model_dir, hidden_size=128, intermediate_size=256, num_layers=2)
        else:
            write_config_dir(model_dir, REPO / "configs" / CONFIGS["8b"])
    config = load_model_config(model_dir)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = get_attention_backend("triton" if device.type == "cuda" else "torch", device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config, backend, 4096, quantization, device).eval()
    finally:
        torch.set_default_dtype(previous)
    init_dummy_weights(model, 0, std=getattr(config, "initializer_range", 0.02))
    return model, config, dtype


def decode_inputs(config, batch: int, context: int, num_blocks: int, block_size: int, device):
    """input ids, positions and metadata of one decode step of `batch` requests at `context`,
    their blocks drawn at random from the cache's pool."""
    import torch

    from worker_svc.layers.attention import AttentionMetadata

    g = torch.Generator().manual_seed(batch)
    width = math.ceil((context + 1) / block_size)
    tables = torch.randint(0, num_blocks, (batch, width), generator=g, dtype=torch.int32)
    positions = torch.full((batch,), context, dtype=torch.int64)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), query_start_loc=torch.arange(batch + 1, dtype=torch.int32).to(device),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32).to(device), block_tables=tables.to(device),
        max_query_len=1, max_seq_len=context + 1, query_lens_cpu=[1] * batch, seq_lens_cpu=[context + 1] * batch)
    ids = torch.randint(0, config.vocab_size, (batch,), generator=g).to(device)
    return ids, positions.to(device), meta


def time_step(model, inputs, device) -> tuple[float, object]:
    """ms per decode step (forward + LM head) as one CUDA graph, and the graph (None on the CPU)."""
    import torch

    ids, positions, meta = inputs
    rows = torch.arange(ids.shape[0], device=device)

    def step():
        return model.compute_logits(model(ids, positions, meta), rows)

    step()
    if device.type != "cuda":
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3, None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    results = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(DECODE_REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end) / DECODE_REPLAYS)
    return statistics.median(results), graph


def kernels_per_layer(graph, num_layers: int) -> dict:
    """Kernels one replay launches, per decoder layer, and the most frequent names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    total = sum(names.values())
    return {"kernels": total, "per_layer": total / num_layers,
            "top": [(name[:80], count) for name, count in names.most_common(12)]}


def run_decode(args: argparse.Namespace) -> dict:
    import torch

    from worker_svc import kv_cache
    from worker_svc.layers.linear_selection import linear_kinds, select_linear_methods
    from worker_svc.models.qwen3 import head_dim_of

    batches = [int(b) for b in args.decode_batches.split(",")]
    if args.tiny:
        batches = [b for b in batches if b <= 8] or [1]
    device = torch.device(args.device)
    results = {}
    for quantization in (None, "fp8"):
        name = quantization or "bf16"
        started = time.perf_counter()
        model, config, dtype = decode_model(args, quantization)
        block_size, num_blocks = 16, 2048 if not args.tiny else 64
        kv_cache.allocate_kv_cache(model, num_blocks, block_size, config.num_key_value_heads, head_dim_of(config),
                                   dtype, device)
        row = {"load_s": time.perf_counter() - started}
        layers = [m for _, group in linear_kinds(model).values() for m in group]
        with torch.inference_mode():
            for planned in (False, True):
                if planned:
                    started = time.perf_counter()
                    choices = select_linear_methods(model, device, dtype, max_rows=max(batches))
                    row["selection_s"] = time.perf_counter() - started
                    row["selection"] = {label: c.summary() for label, c in choices.items()}
                else:
                    for layer in layers:
                        layer.plan = None
                key = "selected" if planned else "before"
                for batch in batches:
                    inputs = decode_inputs(config, batch, args.decode_context, num_blocks, block_size, device)
                    ms, graph = time_step(model, inputs, device)
                    row[f"{key}_ms_b{batch}"] = ms
                    if batch == batches[0] and graph is not None:
                        row[f"{key}_kernels_b{batch}"] = kernels_per_layer(graph, config.num_hidden_layers)
                    del graph
                    print(f"   decode {name} {key} batch {batch}: {ms:.3f} ms", flush=True)
        results[name] = row
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"batches": batches, "context": args.decode_context, "rows": results}


def print_decode(decode: dict) -> None:
    batches = decode["batches"]
    print(f"\nQwen3-8B decode step (forward + LM head, one CUDA graph), context {decode['context']}, ms:")
    print(f"{'weights':8s} {'selection':10s} " + " ".join(f"{'b=' + str(b):>9s}" for b in batches))
    rows = decode["rows"]
    for name, row in rows.items():
        for key in ("before", "selected"):
            print(f"{name:8s} {key:10s} " + " ".join(f"{row.get(f'{key}_ms_b{b}', math.nan):9.3f}" for b in batches))
    if "bf16" in rows and "fp8" in rows:
        for key in ("before", "selected"):
            speedup = [rows["bf16"][f"selected_ms_b{b}"] / rows["fp8"][f"{key}_ms_b{b}"] for b in batches]
            print(f"fp8 {key} vs bf16 selected: " + " ".join(f"{s:8.2f}x" for s in speedup))
        print("  (targets: fp8 >= 1.7x bf16 at batch 1, >= 1.3x at batch 256)")
    for name, row in rows.items():
        for key in ("before", "selected"):
            counts = row.get(f"{key}_kernels_b{batches[0]}")
            if counts:
                print(f"kernels per decoder layer, {name} {key}, batch {batches[0]}: {counts['per_layer']:.1f} "
                      f"({counts['kernels']} per step); most frequent: "
                      + ", ".join(f"{n} x{c}" for n, c in counts["top"][:6]))
        for label, summary in row.get("selection", {}).items():
            print(f"  {name} {label}: {summary}")
