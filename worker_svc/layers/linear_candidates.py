"""The methods the start-up selection (linear_selection) tries for a kind of linear layer at a row
count, the default first: cuBLAS or, for FP8 weights, the FP8 GEMM (fp8_kernels) at its own tile, then
the FP8 paths' other tiles and splits (among them the tiles Hopper's wgmma takes e4m3 from), the few-row
GEMVs (gemv_kernels; some with the RMSNorm before the layer folded in) and, past them, the GEMV's
tensor-core loop as a tiled GEMM. The tile tables are those the H100 / H200 sweeps found worth trying
(docs/PERF_NOTES.md); the split-K factors are sized by the SMs the programs have to fill.
"""
from __future__ import annotations

import math

import torch
import triton

from worker_svc.layers import fp8_kernels, fused_kernels
from worker_svc.layers.gemv_kernels import DOT_MIN_ROWS, ROW_ACC_MAX_ROWS, GemvConfig, split_slices
from worker_svc.layers.linear_methods import Cublas, Dequantized, Fp8Cublas, Fp8Gemm, Gemv, LinearOperands, Method

GEMV_MAX_ROWS = 64
# GEMV tiles tried at start-up: (block_n, block_k, num_warps) for one row, on CUDA-core FMAs
# (a few rows take block_k / rows: the accumulator holds rows x block_n x block_k floats);
# (block_n, block_k, num_warps, num_stages) with one accumulator per row (up to
# ROW_ACC_MAX_ROWS rows) and from 16 rows on tensor cores. Each with split-K as auto_split says
# and without. The tiles are those the H200 sweep (bench/stages/linear.py) found within 5% of
# the best most often.
FMA_TILES = ((4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 512, 8))
ROW_ACC_TILES = ((4, 512, 4, 3), (8, 512, 4, 3), (16, 512, 8, 3))
MIN_FMA_BLOCK_K = 64
DOT_TILES = ((32, 128, 4, 4), (32, 128, 4, 6), (64, 128, 4, 4), (128, 128, 8, 3))
# FP8 GEMM tiles tried with activations quantized on load, past GEMV_MAX_ROWS rows (fewer rows
# try fp8_kernels' own choice).
FP8_GEMM_TILES = (dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3),
                  dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3),
                  dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3))
FP8_PDL_PREFETCH = 2            # K tiles of weights the FP8 GEMM asks into L2 before its PDL wait
# FP8 GEMM tiles for Hopper's wgmma on e4m3 at a few rows: Triton runs 16- and 32-row tiles on mma.sync
# in f16, converting every weight and activation element first (one F2FP per weight element, the
# activations' again in each warp, on the conversion pipe: PERF_NOTES v41); wgmma takes e4m3 from
# 64-row operands. So: the rows padded to a 64-row tile (up to FP8_WGMMA_MAX_ROWS rows: from 33 on
# fp8_kernels' own tile has 64 rows), and up to GEMV_MAX_ROWS the dot swapped (FP8_SWAP_TILES: the
# weight tile as the 64-row operand, the rows as a 16-64-column one, swap_rows), its accumulator 4-16x
# smaller. Input quantized first (by the norms and SwiGLU, as the chosen 16-row tiles take it; the swapped
# ones of o and down also on load: wgmma_candidates), split over K as fp8_split sizes them, each with PDL too.
FP8_WGMMA_TILES = (dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),)
FP8_WGMMA_MAX_ROWS = 32
FP8_SWAP_TILES = (dict(BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4, SWAP_AB=True),
                  dict(BLOCK_N=128, GROUP_M=1, num_warps=4, num_stages=4, SWAP_AB=True))
# Narrow column tiles of the unsplit FP8 GEMM up to FP8_NARROW_MAX_ROWS rows (both activation paths): more
# programs than the 64-column tile gives a 4,096-column weight, each over the whole of K (no partials),
# with deeper pipelines for their smaller loads (PERF_NOTES v38: split-K lost at one row on an H100).
FP8_NARROW_TILES = (dict(BLOCK_N=16, num_stages=8), dict(BLOCK_N=32, num_stages=6))
FP8_NARROW_MAX_ROWS = 16
# Past GEMV_MAX_ROWS, up to FP8_WAVE_SPLIT_MAX_ROWS: the first two FP8_GEMM_TILES with K in two slices
# where their tiles fill less than two waves of the SMs (4,096 columns at 256 rows: 128 tiles; cuBLAS
# runs o and down there at 40-48% of the FP8 rate, PERF_NOTES v36/v38); the partials (8 MB for o) stay in L2.
FP8_WAVE_SPLIT_MAX_ROWS = 512
# Up to this many rows the GEMVs of a layer fed by an RMSNorm are also tried with the norm folded in
# (each program reads its rows' whole activation once more for their inverse RMS: cheap at a few rows).
# Where they are, every candidate is timed with the norm: the norm kernel before it, bf16 or FP8 as it
# takes its input, or none for the folded GEMV.
FOLD_NORM_MAX_ROWS = 4
# Past GEMV_MAX_ROWS, up to TILED_MAX_ROWS rows of bf16 weights: the GEMV kernel's tensor-core loop
# as a tiled GEMM, (block_m, block_n, block_k, num_warps, num_stages), against cuBLAS.
TILED_MAX_ROWS = 512
TILED_TILES = ((64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3))
# Up to WHOLE_SLICE_MAX_ROWS rows, with PDL: FMA tiles whose programs each take one K tile, their whole
# slice of the weight, loaded before the PDL wait (gemv_kernels.whole_slice): (block_n, num_warps), the K
# tile as long as WHOLE_SLICE_WARP_ELEMENTS accumulator elements a warp allow (64 float32 a thread), and half
# that; K split into as many slices as that takes.
WHOLE_SLICE_TILES = ((4, 4), (8, 4), (16, 8))
WHOLE_SLICE_WARP_ELEMENTS = 2048
WHOLE_SLICE_MAX_ROWS = 1   # (at 2 and 4 rows they lost to every other loop on an H100: PERF_NOTES v46)
# From DOT_MIN_ROWS up to GEMV_MAX_ROWS rows, the same on tensor cores (`early_dot`): (block_n, block_k, num_warps),
# one K tile a program, its weights loaded before the wait, K split into as many slices (PERF_NOTES v50). A
# program holds its weight tile and its rows' activation tile in registers at once: 16-32 KB.
WHOLE_SLICE_DOT_TILES = ((16, 512, 4), (32, 256, 4), (64, 128, 4), (32, 128, 4))
SPLIT_PROGRAMS_PER_SM = 8       # auto_split aims at this many programs per SM (short programs balance the tail)
MAX_SPLIT = 16


def auto_split(num_cols: int, width: int, rows: int, config: GemvConfig, sms: int) -> int:
    """Split-K factor that gives about SPLIT_PROGRAMS_PER_SM programs per SM, each with at least
    two K tiles."""
    programs = math.ceil(num_cols / config.block_n) * math.ceil(rows / config.block_m)
    k_tiles = math.ceil(width / config.block_k)
    wanted = math.ceil(SPLIT_PROGRAMS_PER_SM * sms / programs)
    return max(1, min(wanted, k_tiles // 2, MAX_SPLIT))


def fp8_tiles(num_cols: int, rows: int, tile: dict) -> int:
    """Output tiles (programs without a split) of the FP8 GEMM with this tile."""
    return math.ceil(num_cols / tile["BLOCK_N"]) * math.ceil(rows / tile["BLOCK_M"])


def fp8_split(num_cols: int, width: int, rows: int, tile: dict, sms: int, group: int) -> int:
    """Split-K factor of the FP8 GEMM (fp8_kernels' SPLIT_K) that gives about SPLIT_PROGRAMS_PER_SM
    programs per SM, each over at least two of K's groups: at a few rows a 4,096-column weight
    has 64 column tiles, fewer programs than the SMs (PERF_NOTES v36). The float32 partials
    (written and read: 8 bytes a row and column a slice) stay within a quarter of the FP8
    weight's bytes (one a column and K), so more rows split less."""
    wanted = math.ceil(SPLIT_PROGRAMS_PER_SM * sms / fp8_tiles(num_cols, rows, tile))
    split = max(1, min(wanted, width // group // 2, MAX_SPLIT, width // (4 * 8 * rows)))
    return split_slices(width // group, split)[1]   # the slices that run


def swap_rows(rows: int) -> int:
    """The swapped FP8 GEMM's row tile (its dot's narrow operand): the rows' power of two, at least 16."""
    return max(16, triton.next_power_of_2(rows))


def wgmma_tiles(rows: int) -> list[dict]:
    """The FP8 GEMM tiles for wgmma on e4m3 at this few rows: FP8_WGMMA_TILES up to FP8_WGMMA_MAX_ROWS,
    and FP8_SWAP_TILES with swap_rows' row tile."""
    tiles = list(FP8_WGMMA_TILES) if rows <= FP8_WGMMA_MAX_ROWS else []
    return tiles + [{**tile, "BLOCK_M": swap_rows(rows)} for tile in FP8_SWAP_TILES]


def swap_splits(num_cols: int, width: int, rows: int, tile: dict, sms: int, group: int) -> list[int]:
    """The swapped tile's split-K factors: unsplit, fp8_split's, and between them a half and a quarter of
    it (as split_slices rounds them). At one row fp8_split's programs hold 2-6 of K's groups, too few for a
    4-stage pipeline to fill, and unsplit ones too few programs for the SMs (v42: o_proj took 15.3 us
    either way, its GEMV 9.9): fewer, longer programs may sit between the two."""
    split = fp8_split(num_cols, width, rows, tile, sms, group)
    groups = width // group
    return sorted({1, split, *(split_slices(groups, split // d)[1] for d in (2, 4) if split // d > 1)})


def wgmma_candidates(operands: LinearOperands, rows: int, sms: int, pdl: bool) -> list[Method]:
    """The wgmma_tiles, input quantized first: each unsplit and split over K as fp8_split sizes it (the
    swapped ones also at swap_splits' factors between), and each with PDL where graphs replay it. For the
    layers whose input no norm quantizes (o, and down, whose SwiGLU then folds in too) the swapped ones also
    quantize on load (with PDL where graphs replay it): one kernel a layer fewer (PERF_NOTES v43)."""
    methods: list[Method] = []
    shape = (*operands.weight.shape, rows)
    for tile in wgmma_tiles(rows):
        splits = (swap_splits(*shape, tile, sms, operands.block[1]) if tile.get("SWAP_AB")
                  else sorted({1, fp8_split(*shape, tile, sms, operands.block[1])}))
        for slices in splits:
            config = {**tile, "SPLIT_K": slices}
            pdl_config = {**config, "PDL": True, "PREFETCH": FP8_PDL_PREFETCH}
            methods.append(Fp8Gemm.of(config, quantize_on_load=False))
            if pdl:
                methods.append(Fp8Gemm.of(pdl_config, quantize_on_load=False))
            if tile.get("SWAP_AB") and not operands.norm_fed:
                methods.append(Fp8Gemm.of(pdl_config if pdl else config, quantize_on_load=True))
    return methods


def gemv_configs(rows: int, num_cols: int, width: int, sms: int, pdl: bool = True,
                 fp8: bool = False) -> list[GemvConfig]:
    """The GEMV launch settings tried at this row count (with programmatic dependent launch
    where the graphs replay it: pdl_launch.pdl_in_graphs), for FP8 weights with `fp8`."""
    block_m = triton.next_power_of_2(rows)
    if block_m < DOT_MIN_ROWS:
        bases = [GemvConfig(block_m, n, max(MIN_FMA_BLOCK_K, k // block_m), num_warps=w, num_stages=1, pdl=pdl)
                 for n, k, w in FMA_TILES]
        if block_m <= ROW_ACC_MAX_ROWS:
            bases += [GemvConfig(block_m, n, max(MIN_FMA_BLOCK_K, k // block_m), num_warps=w, num_stages=s, pdl=pdl,
                                 row_acc=True) for n, k, w, s in ROW_ACC_TILES]
        # Tensor cores on a 16-row tile may beat CUDA cores on a few rows, and on one row of FP8
        # weights (converted to 16 bits for the dot, where the FMA loop converts them to 32).
        if rows > 1 or fp8:
            bases += [GemvConfig(DOT_MIN_ROWS, n, k, num_warps=w, num_stages=s, pdl=pdl) for n, k, w, s in DOT_TILES]
    else:
        bases = [GemvConfig(block_m, n, k, num_warps=w, num_stages=s, pdl=pdl) for n, k, w, s in DOT_TILES]
    if fp8:   # tensor-core tiles also taking FP8 weights by their bits: no per-element f16 -> bf16
        # conversion (the CUDA-core loops' packed conversion costs fewer instructions than the move:
        # PERF_NOTES v38; the bench's sweep times both)
        bases += [GemvConfig(**{**base.__dict__, "fp8_bits": True}) for base in bases if base.use_dot]
    configs = []
    for base in bases:
        split = auto_split(num_cols, width, rows, base, sms)
        configs += [GemvConfig(**{**base.__dict__, "split_k": s}) for s in sorted({1, split})]
    return configs


def whole_slice_configs(rows: int, width: int, pdl: bool) -> list[GemvConfig]:
    """The GEMV launches whose programs read their whole weight slice before the PDL wait (none
    without PDL, or between WHOLE_SLICE_MAX_ROWS and DOT_MIN_ROWS rows, or past GEMV_MAX_ROWS)."""
    block_m = triton.next_power_of_2(rows)
    if not pdl or rows > GEMV_MAX_ROWS:
        return []
    if block_m >= DOT_MIN_ROWS:
        return [GemvConfig(block_m, n, k, split_k=math.ceil(width / k), num_warps=w, num_stages=1, pdl=True,
                           early_dot=True)
                for n, k, w in WHOLE_SLICE_DOT_TILES if math.ceil(width / k) <= MAX_SPLIT]
    if rows > WHOLE_SLICE_MAX_ROWS:
        return []
    configs = []
    for block_n, warps in WHOLE_SLICE_TILES:
        longest = WHOLE_SLICE_WARP_ELEMENTS * warps // (block_m * block_n)
        for block_k in sorted({min(triton.next_power_of_2(width), longest), longest // 2}, reverse=True):
            split = math.ceil(width / block_k)
            if block_k >= MIN_FMA_BLOCK_K and split <= MAX_SPLIT:
                configs.append(GemvConfig(block_m, block_n, block_k, split_k=split, num_warps=warps, num_stages=1,
                                          pdl=True))
    return configs


def candidates(operands: LinearOperands, rows: int, dtype: torch.dtype, sms: int, pdl: bool = True) -> list[Method]:
    """The methods measured at this row count, the default first."""
    if operands.fp8:
        default = fp8_kernels._matmul_config(rows)
        tiles = [default] if rows <= GEMV_MAX_ROWS else [default, *(t for t in FP8_GEMM_TILES if t != default)]
        methods: list[Method] = [Fp8Gemm.of(default, quantize_on_load=False),
                                 *(Fp8Gemm.of(t, quantize_on_load=True) for t in tiles), Fp8Cublas(), Dequantized()]
        if rows <= GEMV_MAX_ROWS:   # few column tiles: K split over more programs, both activation paths
            split = fp8_split(*operands.weight.shape, rows, default, sms, operands.block[1])
            if split > 1:
                methods += [Fp8Gemm.of({**default, "SPLIT_K": split}, quantize_on_load=on_load)
                            for on_load in (False, True)]
            if pdl:   # the weights' first tiles asked for while the kernel before ends (as the GEMVs do)
                methods += [Fp8Gemm.of({**default, "SPLIT_K": s, "PDL": True, "PREFETCH": FP8_PDL_PREFETCH},
                                       quantize_on_load=False) for s in sorted({1, split})]
            methods += wgmma_candidates(operands, rows, sms, pdl)   # FP8 tensor cores without conversions
        elif rows <= FP8_WAVE_SPLIT_MAX_ROWS:
            methods += [Fp8Gemm.of({**tile, "SPLIT_K": 2}, quantize_on_load=False) for tile in FP8_GEMM_TILES[:2]
                        if fp8_tiles(operands.weight.shape[0], rows, tile) < 2 * sms]
        if rows <= FP8_NARROW_MAX_ROWS:   # quantized first (by the norm before qkv and gate_up), or on load
            for narrow in ({**default, **tile} for tile in FP8_NARROW_TILES):   # (o: no quantization kernel)
                methods += [Fp8Gemm.of(narrow, quantize_on_load=False), Fp8Gemm.of(narrow, quantize_on_load=True)]
                if pdl:
                    methods.append(Fp8Gemm.of({**narrow, "PDL": True, "PREFETCH": FP8_PDL_PREFETCH},
                                              quantize_on_load=False))
    else:
        methods = [Cublas()]
    if rows <= GEMV_MAX_ROWS:
        configs = gemv_configs(rows, *operands.weight.shape, sms, pdl, operands.fp8)
        configs += [c for c in whole_slice_configs(rows, operands.weight.shape[1], pdl) if c not in configs]
        methods += [Gemv(config) for config in configs]
        if rows <= FOLD_NORM_MAX_ROWS and operands.norm_fed and fused_kernels.ENABLED:
            # the RMSNorm before the layer computed in the GEMV (its launch gone; Gemv.supports says where)
            methods += [Gemv(config, fold_norm=True) for config in configs]
    elif rows <= TILED_MAX_ROWS and not operands.fp8:
        methods += [Gemv(config, max_rows=TILED_MAX_ROWS) for config in tiled_configs(rows, *operands.weight.shape, sms)]
    return [m for m in methods if m.supports(operands, dtype)]


def tiled_configs(rows: int, num_cols: int, width: int, sms: int) -> list[GemvConfig]:
    """The GEMV kernel's tensor-core loop as a tiled GEMM past GEMV_MAX_ROWS rows (bf16 weights):
    TILED_TILES, each unsplit and, where its tiles fill less than two waves of the SMs, with K
    split so they do (cuBLAS leaves half the SMs idle on Qwen3-0.6B's 256-row projections:
    PERF_NOTES v39)."""
    configs = []
    for block_m, block_n, block_k, warps, stages in TILED_TILES:
        base = GemvConfig(block_m, block_n, block_k, num_warps=warps, num_stages=stages)
        tiles = math.ceil(rows / block_m) * math.ceil(num_cols / block_n)
        configs.append(base)
        if tiles < 2 * sms:
            split = max(1, min(math.ceil(2 * sms / tiles), math.ceil(width / block_k) // 4, MAX_SPLIT))
            if split > 1:
                configs.append(GemvConfig(**{**base.__dict__, "split_k": split}))
    return configs
