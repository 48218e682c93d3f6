"""Probe: a decode step's kernels under Nsight Compute's hardware counters (PERF_NOTES v56).

`run` (under ncu): a ModelRunner in this process (the profile stage's setup: one context for every
request, the KV cache sized to them), warm-up decodes, then ONE decode step (a CUDA-graph replay)
between cudaProfilerStart / Stop, so `ncu --profile-from-start off` measures that step's kernels
alone, each replayed in isolation (serialized: no PDL overlap, L2 flushed before each pass).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --export OUT/r16 python3 -m bench.probes.ncu_decode run --model DIR --batch 16
    ncu --import OUT/r16.ncu-rep --csv --page raw > OUT/r16.csv
    python3 -m bench.probes.ncu_decode table OUT/r16.csv [--copy-tbs 3.04]

`table`: the step's kernels grouped by name and launch shape (a layer's projections share a kernel and
differ by grid): calls a step, median time, DRAM bytes and rate (and against --copy-tbs, the copy
bandwidth the bench measured), achieved / theoretical occupancy, waves, registers and shared memory a
block, and the warps' top stall reasons (cycles a warp spends stalled per issued instruction).
With `run --device cpu` and a tiny model it exercises the setup without a GPU.
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import statistics
import sys

import numpy as np


def run(args: argparse.Namespace) -> None:
    import torch

    from bench.stages.profile import _step, prefill_contexts
    from worker_svc.config import WorkerConfig
    from worker_svc.layers.sampler import SamplingOptions
    from worker_svc.model_runner import ModelRunner

    warm = 4
    block_size = 16
    blocks_per_seq = -(-(args.context + warm + 2 + 1) // block_size)
    runner = ModelRunner(WorkerConfig(
        model=args.model, device=args.device, max_num_seqs=args.batch, max_num_batched_tokens=16384,
        max_model_len=args.context + warm + 16, load_format=args.load_format, quantization=args.quantization,
        lm_head_dtype=args.lm_head_dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=block_size,
        num_kv_blocks=args.batch * blocks_per_seq + 1))
    seq_ids = list(range(1, args.batch + 1))
    step_id = prefill_contexts(runner, seq_ids, args.context, blocks_per_seq, np.random.default_rng(0),
                               SamplingOptions(temperature=1.0), 0)
    for _ in range(warm):
        step_id += 1
        _step(runner, step_id, cached=seq_ids)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    step_id += 1
    _step(runner, step_id, cached=seq_ids)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_decode: batch {args.batch} x {args.context}: one decode step profiled", flush=True)


STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def _short(name: str) -> str:
    name = re.sub(r"\(.*", "", name)         # the demangled signature
    name = re.sub(r"^void\s+", "", name)
    return name[:38]


def table(args: argparse.Namespace) -> None:
    with open(args.csv, newline="") as f:
        lines = [line for line in f if line.startswith('"')]   # ncu's own messages are not quoted
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        print(f"{args.csv}: no kernels")
        return
    header, data = rows[0], rows[2:]    # rows[1]: units
    col = {name: i for i, name in enumerate(header)}

    def get(row, name):
        return _number(row[col[name]]) if name in col else float("nan")

    stalls = [(m.group(1), i) for name, i in col.items() if (m := STALL.match(name))]
    groups: dict[tuple, list] = collections.defaultdict(list)
    for row in data:
        key = (_short(row[col["Kernel Name"]]), row[col.get("Grid Size", 0)], row[col.get("Block Size", 0)])
        groups[key].append(row)
    total_ns = sum(get(r, "gpu__time_duration.sum") for r in data)
    print(f"{len(data)} kernels, {total_ns / 1e3:.1f} us serialized (each alone, L2 flushed)")
    print(f"{'kernel':38} {'grid':>14} {'n':>3} {'us':>7} {'MB':>7} {'TB/s':>5} {'copy%':>5} {'dram%':>5} "
          f"{'occ':>9} {'waves':>5} {'regs':>4} {'smemKB':>6}  top stalls (cycles/issue)")
    order = sorted(groups.items(), key=lambda kv: -sum(get(r, "gpu__time_duration.sum") for r in kv[1]))
    for (name, grid, _block), members in order:
        def med(metric, members=members):
            return statistics.median(get(r, metric) for r in members)
        ns = med("gpu__time_duration.sum")
        mb = med("dram__bytes_read.sum") / 1e6 + med("dram__bytes_write.sum") / 1e6
        tbs = mb * 1e6 / ns / 1e3 if ns else float("nan")
        smem = (med("launch__shared_mem_per_block_static") + med("launch__shared_mem_per_block_dynamic")) / 1024
        top = sorted(((statistics.median(_number(r[i]) for r in members), s) for s, i in stalls), reverse=True)[:3]
        print(f"{name:38} {grid:>14} {len(members):3d} {ns / 1e3:7.2f} {mb:7.2f} {tbs:5.2f} "
              f"{100 * tbs / args.copy_tbs if args.copy_tbs else float('nan'):5.0f} "
              f"{med('dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.0f} "
              f"{med('sm__warps_active.avg.pct_of_peak_sustained_active'):4.0f}/"
              f"{med('sm__maximum_warps_per_active_cycle_pct'):<4.0f} {med('launch__waves_per_multiprocessor'):5.2f} "
              f"{med('launch__registers_per_thread'):4.0f} {smem:6.1f}  "
              + ", ".join(f"{s} {v:.1f}" for v, s in top))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--context", type=int, default=1024)
    r.add_argument("--device", default="cuda")
    r.add_argument("--load-format", default="auto")
    r.add_argument("--quantization", default=None)
    r.add_argument("--lm-head-dtype", default="auto")
    r.add_argument("--kv-cache-dtype", default="auto")
    t = sub.add_parser("table")
    t.add_argument("csv")
    t.add_argument("--copy-tbs", type=float, default=0.0, help="the copy bandwidth (TB/s) for the copy%% column")
    args = p.parse_args(argv)
    run(args) if args.command == "run" else table(args)


if __name__ == "__main__":
    sys.exit(main())
