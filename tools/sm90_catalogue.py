"""The launches tools/sm90_compile.py compiles: each layer's Python wrapper called on CPU tensors
as the model calls it on a GPU (Qwen3-0.6B / 8B shapes, bf16; FP8 weights in 128 x 128 blocks), at
several row counts of decode steps (DECODE_ROWS), so a step's row count never picks a new variant.
`catalogue()` names the cases; inside tools.sm90_compile.offline_compiles each launch only compiles.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

DECODE_ROWS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 64, 100, 256)   # a step's row counts (graphs capture some)


@contextlib.contextmanager
def _as_on_a_hopper() -> Iterator[None]:
    """Within: the layers launch as on an H100 (pdl_launch's PDL launches, the norms' triggers and
    the chain's waits), so those variants compile too."""
    from worker_svc.layers import pdl_launch

    saved = pdl_launch.pdl_launches, pdl_launch.pdl_triggers, pdl_launch.pdl_waits
    pdl_launch.pdl_launches = pdl_launch.pdl_triggers = pdl_launch.pdl_waits = lambda device: True
    try:
        yield
    finally:
        pdl_launch.pdl_launches, pdl_launch.pdl_triggers, pdl_launch.pdl_waits = saved


def catalogue(extended: bool = False) -> dict[str, Callable[[], None]]:
    """Named cases, each calling wrappers as the model calls them on a GPU (Qwen3-0.6B / 8B shapes,
    bf16; FP8 weights in 128 x 128 blocks) over DECODE_ROWS. `extended` adds the slow ones (each
    compiles the sampler's finish kernel again, ~25 s), which run only when named."""
    import torch

    bf16 = torch.bfloat16
    cases: dict[str, Callable[[], None]] = {}

    def fused() -> None:
        from worker_svc.layers import fused_kernels as fk
        with _as_on_a_hopper():   # the norms' and SwiGLU's PDL trigger
            fk.rms_norm(torch.randn(3, 1024, dtype=bf16), torch.ones(1024, dtype=bf16), 1e-6)
            fk.rms_norm_fp8(torch.randn(3, 1024, dtype=bf16), torch.ones(1024, dtype=bf16), 1e-6, None, 128)
            fk.silu_and_mul(torch.randn(3, 2 * 3072, dtype=bf16))
            fk.silu_and_mul_fp8(torch.randn(3, 2 * 3072, dtype=bf16), 128)
        for rows in DECODE_ROWS:
            for hidden in (1024, 4096):
                x, r = torch.randn(rows, hidden, dtype=bf16), torch.randn(rows, hidden, dtype=bf16)
                w = torch.ones(hidden, dtype=bf16)
                fk.rms_norm(x, w, 1e-6, r)
                fk.rms_norm(x, w, 1e-6)
                fk.rms_norm_fp8(x, w, 1e-6, r, 128)
                fk.rms_norm_fp8(x, w, 1e-6, None, 128)
                gate_up = torch.randn(rows, 2 * 3 * hidden, dtype=bf16)
                fk.silu_and_mul(gate_up)
                fk.silu_and_mul_fp8(gate_up, 128)
    cases["fused"] = fused

    def fp8() -> None:
        from worker_svc.layers import fp8_kernels as f8
        from worker_svc.layers.linear_candidates import (FP8_GEMM_TILES, FP8_NARROW_MAX_ROWS, FP8_NARROW_TILES,
                                                         FP8_WAVE_SPLIT_MAX_ROWS, GEMV_MAX_ROWS, wgmma_tiles)
        weight = torch.zeros(1024, 4096, dtype=torch.float8_e4m3fn)
        weight_scale = torch.ones(8, 32)
        for rows in DECODE_ROWS:
            x = torch.randn(rows, 4096, dtype=bf16)
            gate_up = torch.randn(rows, 8192, dtype=bf16)   # the down projection's SwiGLU on load
            f8.per_token_group_quant(x, 128)
            f8.quantize_activation(x, 128)
            f8.fp8_linear(x, weight, weight_scale, (128, 128))
            f8.fp8_linear(x, weight, weight_scale, (128, 128), quantize_on_load=True)
            f8.fp8_linear(gate_up, weight, weight_scale, (128, 128), quantize_on_load=True, silu_mul=True)
            f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128))
            if rows <= 64:   # split-K, as linear_candidates' few-row candidates run it, and with PDL
                split = dict(f8._matmul_config(rows), SPLIT_K=8)
                f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128), config=split)
                f8.fp8_linear(x, weight, weight_scale, (128, 128), quantize_on_load=True, config=split)
                f8.fp8_linear(gate_up, weight, weight_scale, (128, 128), quantize_on_load=True, silu_mul=True,
                              config=split)
                with _as_on_a_hopper():
                    for slices in (1, 8):
                        for late in (False, True):   # the trigger at the start, or after the loop
                            f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128),
                                          config={**split, "SPLIT_K": slices, "PDL": True, "PREFETCH": 2,
                                                  "LATE_TRIGGER": late})
            if rows <= GEMV_MAX_ROWS:   # the tiles for wgmma on e4m3 at a few rows, split and not, with PDL
                for tile in wgmma_tiles(rows):
                    for slices in (1, 8):
                        config = {**tile, "SPLIT_K": slices}
                        f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128), config=config)
                        with _as_on_a_hopper():
                            for late in (False, True):
                                f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128),
                                              config={**config, "PDL": True, "PREFETCH": 2, "LATE_TRIGGER": late})
                            if tile.get("SWAP_AB"):   # quantized on load (o), with SwiGLU (down), with PDL
                                pdl = {**config, "PDL": True, "PREFETCH": 2}
                                f8.fp8_linear(x, weight, weight_scale, (128, 128), quantize_on_load=True, config=pdl)
                                f8.fp8_linear(gate_up, weight, weight_scale, (128, 128), quantize_on_load=True,
                                              silu_mul=True, config=pdl)
            if GEMV_MAX_ROWS < rows <= FP8_WAVE_SPLIT_MAX_ROWS:   # the prefill tiles with K in two slices
                for tile in FP8_GEMM_TILES[:2]:
                    f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128),
                                  config={**tile, "SPLIT_K": 2})
            if rows <= FP8_NARROW_MAX_ROWS:   # narrow column tiles over the whole of K, with PDL too
                for tile in FP8_NARROW_TILES:
                    narrow = {**f8._matmul_config(rows), **tile}
                    f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128), config=narrow)
                    f8.fp8_linear(x, weight, weight_scale, (128, 128), quantize_on_load=True, config=narrow)
                    f8.fp8_linear(gate_up, weight, weight_scale, (128, 128), quantize_on_load=True, silu_mul=True,
                                  config=narrow)
                    with _as_on_a_hopper():
                        for late in (False, True):
                            f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128),
                                          config={**narrow, "PDL": True, "PREFETCH": 2, "LATE_TRIGGER": late})
    cases["fp8"] = fp8

    def gemv() -> None:
        from worker_svc.layers import gemv_kernels
        from worker_svc.layers.linear_candidates import gemv_configs, tiled_configs, whole_slice_configs
        weight = torch.randn(1024, 4096, dtype=bf16)
        fp8_weight = weight.to(torch.float8_e4m3fn)
        weight_scale = torch.ones(8, 32)
        with _as_on_a_hopper():   # the PDL variants (gdc_wait, prefetches), as on a GPU
            for rows in (1, 2, 4, 8, 16, 32, 64):
                configs = gemv_configs(rows, 1024, 4096, sms=132, pdl=True, fp8=True)
                if rows in (1, 2, 16):   # twins with the trigger after the loop (timed where their config wins):
                    # the loops' three families (FMA, one accumulator a row, tensor cores), not every tile
                    configs += [dataclasses.replace(c, late_trigger=True) for c in configs if not c.fp8_bits]
                for config in configs:
                    x = torch.randn(rows, 4096, dtype=bf16)
                    for n in sorted({rows, max(1, rows - 1)}):   # the bucket's smaller row counts run its config
                        gemv_kernels.gemv(x[:n], weight, config)
                        gemv_kernels.gemv(x[:n], fp8_weight, config, weight_scale=weight_scale, fp8_block=(128, 128))
                    if rows in (16, 32) and not config.fp8_bits:   # SwiGLU through the layout fence (mma.sync tiles)
                        gemv_kernels.gemv(torch.randn(rows, 8192, dtype=bf16), weight, config, silu_mul=True)
            # past the GEMV's rows, bf16 weights: the tensor-core loop as a tiled GEMM (SwiGLU's down projection too)
            for rows in (100, 256, 512):
                for config in tiled_configs(rows, 1024, 4096, sms=132):
                    x = torch.randn(rows, 4096, dtype=bf16)
                    gemv_kernels.gemv(x, weight, config)
                    gemv_kernels.gemv(torch.randn(rows, 8192, dtype=bf16), weight, config, silu_mul=True)
            # the RMSNorm folded in (qkv and gate_up at up to FOLD_NORM_MAX_ROWS rows), with and without the residual
            for rows in (1, 2, 4):
                for config in gemv_configs(rows, 1024, 4096, sms=132, pdl=True, fp8=True):
                    if config.row_acc or config.fp8_bits:
                        continue
                    x = torch.randn(rows, 4096, dtype=bf16)
                    for residual in (None, torch.randn(rows, 4096, dtype=bf16)):
                        norm = gemv_kernels.FoldedNorm(torch.ones(4096, dtype=bf16), 1e-6, residual)
                        gemv_kernels.gemv(x, weight, config, norm=norm)
                        gemv_kernels.gemv(x, fp8_weight, config, weight_scale=weight_scale, fp8_block=(128, 128),
                                          norm=norm)
            # the launches that read their whole weight slice before the PDL wait (PERF_NOTES v46), at the
            # widths of Qwen3-0.6B's and Qwen3-8B's projections: plain, SwiGLU's, the norm folded, FP8 weights
            for rows in (1,):
                for width in (1024, 3072, 4096):
                    w = torch.randn(1024, width, dtype=bf16)
                    x = torch.randn(rows, width, dtype=bf16)
                    norm = gemv_kernels.FoldedNorm(torch.ones(width, dtype=bf16), 1e-6, torch.randn(rows, width, dtype=bf16))
                    for config in whole_slice_configs(rows, width, pdl=True):
                        gemv_kernels.gemv(x, w, config)
                        gemv_kernels.gemv(torch.randn(rows, 2 * width, dtype=bf16), w, config, silu_mul=True)
                        gemv_kernels.gemv(x, w, config, norm=norm)
                        if width == 4096:   # (the scales of the other cases: one compile for their stride)
                            gemv_kernels.gemv(x, w.to(torch.float8_e4m3fn), config, weight_scale=torch.ones(8, 32),
                                              fp8_block=(128, 128))
            # and on tensor cores from 16 rows (early_dot, v50): plain and SwiGLU's, FP8 weights where K tiles fit
            for rows in (16, 64):
                for width in (1024, 3072):
                    w = torch.randn(1024, width, dtype=bf16)
                    for config in whole_slice_configs(rows, width, pdl=True):
                        gemv_kernels.gemv(torch.randn(rows, width, dtype=bf16), w, config)
                        gemv_kernels.gemv(torch.randn(rows, 2 * width, dtype=bf16), w, config, silu_mul=True)
                        if width == 1024 and config.block_k <= 128:
                            gemv_kernels.gemv(torch.randn(rows, width, dtype=bf16), w.to(torch.float8_e4m3fn), config,
                                              weight_scale=torch.ones(8, 8), fp8_block=(128, 128))
            # the CUDA-core loops taking FP8 weights by their bits (the bench's sweep times them)
            for config in (gemv_kernels.GemvConfig(1, 8, 512, num_warps=4, num_stages=1, pdl=True, fp8_bits=True),
                           gemv_kernels.GemvConfig(4, 8, 128, num_warps=4, num_stages=3, pdl=True, row_acc=True,
                                                   fp8_bits=True)):
                for rows in (1, 3):
                    gemv_kernels.gemv(torch.randn(rows, 4096, dtype=bf16), fp8_weight, config, weight_scale=weight_scale,
                                      fp8_block=(128, 128))
    cases["gemv"] = gemv

    cases.update(_attention_cases())
    cases.update(_moe_cases())
    cases.update(_sampling_cases(extended))
    cases.update(_step_input_cases())
    return cases


# --- attention (worker_svc/layers/attention): the Triton backend, the fused q/k norm + RoPE + store --

HOPPER_SMS = 132          # multiprocessors of an H100 SXM / H200: split-K is sized by them
QWEN3_06B_ATTENTION = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16)
DECODE_CONTEXTS = (5, 40, 1000)   # block tables 1, 3 and 63 blocks wide (block size 16)
# Request counts at which the benchmarks' launch options (a split merge of its own, the decode kernel
# on CUDA cores) compile too: each count a split-K factor of its own, so every count costs variants.
SEPARATE_MERGE_ROWS = (17,)


@contextlib.contextmanager
def _hopper_multiprocessors() -> Iterator[None]:
    """triton_kernels sizes split-K (NUM_SPLITS, a constant) by the GPU's multiprocessors; on the CPU
    it counts 4, which would never split a decode. Within: an H100's 132."""
    from worker_svc.layers.attention import triton_kernels

    counted = triton_kernels._multiprocessor_count
    triton_kernels._multiprocessor_count = lambda device: HOPPER_SMS
    try:
        yield
    finally:
        triton_kernels._multiprocessor_count = counted


def _attention_cases() -> dict[str, Callable[[], None]]:
    import torch

    bf16 = torch.bfloat16
    cpu = torch.device("cpu")

    def run(kv_fp8: bool) -> None:
        from worker_svc.layers import fused_kernels
        from worker_svc.layers.attention import decode_qk, qkv_store
        from worker_svc.layers.attention import triton_kernels as tk
        from worker_svc.layers.attention.base import AttentionMetadata, longest_first_order
        from worker_svc.layers.attention.kv_quant import FP8_KV_DTYPE
        from worker_svc.layers.attention.selection import AttentionShape, synthetic_kv_scales, synthetic_step
        from worker_svc.layers.attention.triton_backend import TritonAttentionBackend

        dims = QWEN3_06B_ATTENTION
        heads, kv_heads, head_dim = dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]
        shape = AttentionShape(heads, kv_heads, head_dim, bf16, dims["block_size"], max_num_seqs=256,
                               max_num_batched_tokens=8192, max_model_len=40960,
                               kv_cache_dtype=FP8_KV_DTYPE if kv_fp8 else None)
        backend = TritonAttentionBackend()
        scales = synthetic_kv_scales(shape, cpu)
        scale = head_dim ** -0.5
        q_weight = k_weight = torch.ones(head_dim, dtype=bf16)

        def step(requests, seed):
            return synthetic_step(requests, shape, cpu, pool_blocks=64, seed=seed)

        def model_path(step_tensors) -> None:
            """As the model runs a layer on CUDA (rotary.attend_qkv): the packed qkv projection
            normalised, rotated and stored in one kernel, then the backend attends over q, a view; a
            pure-decode step's launch may take the projection itself (decode_qk.py)."""
            q, _, _, k_cache, v_cache, meta = step_tensors
            qkv = torch.randn(q.shape[0], (heads + 2 * kv_heads) * head_dim, dtype=bf16)
            cos_sin = torch.randn(q.shape[0], head_dim)
            if meta.is_pure_decode:   # both, whichever the step's rows pick (decode_qk.takes)
                raw_q = qkv[:, :heads * head_dim].view(-1, heads, head_dim)
                qk = decode_qk.DecodeQK(qkv, q_weight, k_weight, 1e-6, 1e-6, cos_sin, meta.slot_mapping)
                backend.attend_decode_qk(raw_q, qk, k_cache, v_cache, meta, scale, scales)
            q_view = qkv_store.qk_norm_rope_store(qkv, q_weight, k_weight, 1e-6, 1e-6, cos_sin, heads, kv_heads,
                                                  k_cache, v_cache, meta.slot_mapping, scales)
            backend.attend(q_view, k_cache, v_cache, meta, scale, scales)

        def unfused_path(step_tensors) -> None:
            """fused_kernels.qk_norm_rope_ in place over qkv, then the backend's own store (k and v
            are views of qkv) and attention: rotary.norm_and_rotate_qkv's CUDA path."""
            q, _, _, k_cache, v_cache, meta = step_tensors
            qkv = torch.randn(q.shape[0], (heads + 2 * kv_heads) * head_dim, dtype=bf16)
            fused_kernels.qk_norm_rope_(qkv, q_weight, k_weight, 1e-6, 1e-6, torch.randn(q.shape[0], head_dim),
                                        heads, kv_heads)
            parts = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            q, k, v = (part.view(-1, n, head_dim) for part, n in zip(parts, (heads, kv_heads, kv_heads)))
            backend.forward(q, k, v, k_cache, v_cache, meta, scale, scales)

        with _hopper_multiprocessors(), _as_on_a_hopper():   # attention triggers the o projection's launch
            # Pure decode (eager: tables as wide as the step's longest context; the split-K factor, a
            # constant, follows the request count by design: decode_variant_counts).
            for rows in DECODE_ROWS:
                for context in DECODE_CONTEXTS:
                    tensors = step([(context, 1)] * rows, seed=rows)
                    backend.forward(*tensors, scale, scales)
                    model_path(tensors)
                q, _, _, k_cache, v_cache, meta = tensors
                if rows in SEPARATE_MERGE_ROWS:   # the merge as its own launch (benchmarks and tests)
                    tk.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       scale, pure_decode=True, kv_scales=scales, fused_merge=False)
                if rows >= 64:   # programs handed out longest first (WORKER_ATTENTION_LONGEST_FIRST)
                    tk.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       scale, pure_decode=True, kv_scales=scales,
                                       decode_order=longest_first_order(meta.seq_lens))
            # Decode graphs: static buffers of the largest batch, tables max_blocks_per_seq wide,
            # padding rows with slot -1 and length 0.
            largest, max_blocks = 256, 2560
            q, _, _, k_cache, v_cache, _ = step([(1000, 1)] * largest, seed=0)
            static = dict(slot_mapping=torch.full((largest,), -1, dtype=torch.int64),
                          seq_lens=torch.zeros(largest, dtype=torch.int32),
                          block_tables=torch.zeros(largest, max_blocks, dtype=torch.int32),
                          query_start_loc=torch.arange(largest + 1, dtype=torch.int32))
            for rows in DECODE_ROWS:
                meta = AttentionMetadata(
                    slot_mapping=static["slot_mapping"][:rows], query_start_loc=static["query_start_loc"][:rows + 1],
                    seq_lens=static["seq_lens"][:rows], block_tables=static["block_tables"][:rows],
                    max_query_len=1, max_seq_len=40960, query_lens_cpu=[1] * rows, seq_lens_cpu=[40960] * rows)
                model_path((q[:rows], None, None, k_cache, v_cache, meta))
            # Prefill: a fresh prompt, a chunk over a cached prefix; mixed steps: a prompt chunk beside
            # rows - 1 decodes (an FP8 cache sends those to the decode kernel: MIXED_DECODES_APART_FP8).
            for seed, requests in enumerate(([(0, 256)], [(2000, 512)], [(0, 7)], [(300, 17), (0, 64)])):
                tensors = step(requests, seed=seed)
                backend.forward(*tensors, scale, scales)
                model_path(tensors)
                unfused_path(tensors)
            for rows in DECODE_ROWS:
                for context in (40, 1000):
                    tensors = step([(0, 200)] + [(context, 1)] * (rows - 1), seed=rows)
                    backend.forward(*tensors, scale, scales)
                    model_path(tensors)
                tensors = step([(1500, 64)] + [(1000, 1)] * rows, seed=rows)   # a chunk over a prefix
                backend.forward(*tensors, scale, scales)
                if kv_fp8 and rows in SEPARATE_MERGE_ROWS:   # its decodes apart, merged by their own launch
                    q, _, _, k_cache, v_cache, meta = tensors
                    tk.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       scale, pure_decode=False, kv_scales=scales, fused_merge=False)
            if kv_fp8:   # the decode kernel on the CUDA cores (GQA_FMA: a launch override of benchmarks)
                for rows in SEPARATE_MERGE_ROWS:
                    q, _, _, k_cache, v_cache, meta = step([(1000, 1)] * rows, seed=rows)
                    tk.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                       scale, pure_decode=True, kv_scales=scales,
                                       launch=tk.LaunchConfig(16, 32, 4, 2, kernel=tk.GQA_FMA))

    return {"attention_bf16": lambda: run(False), "attention_fp8": lambda: run(True)}


# --- MoE (worker_svc/layers/moe_kernels.py): routing, the sort by expert, the grouped GEMMs ----------

def _moe_cases() -> dict[str, Callable[[], None]]:
    import torch

    bf16 = torch.bfloat16

    def moe() -> None:
        """moe.SparseMoeBlock's call (fused_moe) on 8 experts, top-2, hidden 1024, expert width 768,
        bf16 experts and FP8 ones in 128 x 128 blocks; the tile config and the FP8 activation mode
        are constants chosen by rows per expert, by design (moe_config, default_fp8_activations)."""
        from worker_svc.layers import moe_kernels
        from worker_svc.layers.fp8 import FP8_DTYPE

        experts, top_k, hidden, width, block = 8, 2, 1024, 768, (128, 128)
        w13 = torch.randn(experts, 2 * width, hidden, dtype=bf16)
        w2 = torch.randn(experts, hidden, width, dtype=bf16)
        q13, q2 = w13.to(FP8_DTYPE), w2.to(FP8_DTYPE)
        s13 = torch.ones(experts, 2 * width // block[0], hidden // block[1])
        s2 = torch.ones(experts, hidden // block[0], width // block[1])
        for rows in DECODE_ROWS:
            x = torch.randn(rows, hidden, dtype=bf16)
            logits = torch.randn(rows, experts, dtype=bf16)
            moe_kernels.fused_moe(x, logits, w13, w2, top_k, True)
            moe_kernels.fused_moe(x, logits, q13, q2, top_k, True, w13_scale=s13, w2_scale=s2, block=block)
            for mode in ("weight_only", "on_load", *moe_kernels.WIDE_MODES):   # any, at any size: moe_selection's
                moe_kernels.fused_moe(x, logits, q13, q2, top_k, True, w13_scale=s13, w2_scale=s2, block=block,
                                      fp8_activations=mode)
            weights, ids = moe_kernels.route_topk(logits, top_k, False)   # without renormalisation
            if rows in (1, 100):   # FP8 activations quantized by their own kernel first ("given": tests only;
                # fused_moe picks weight-only up to 16 rows an expert, quantized on load past that)
                moe_kernels.fused_experts(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, block=block,
                                          fp8_activations="given")

    return {"moe": moe}


# --- sampling (worker_svc/layers/device_sampler.py and its kernels) ----------------------------------

SAMPLING_MODES = (dict(temperature=0.0), dict(temperature=0.7), dict(top_k=20), dict(top_p=0.9),
                  dict(min_p=0.05), dict(temperature=1.3, top_k=50, top_p=0.8, min_p=0.02),
                  dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2, top_p=0.95),
                  dict(logit_bias=((3, 5.0), (17, -100.0)), logprobs=True, seed=7))


def _sampling_cases(extended: bool) -> dict[str, Callable[[], None]]:
    import numpy as np
    import torch

    def run(vocab: int, dtype: torch.dtype, eager_rows: bool) -> None:
        """DeviceSampler as the runner drives it: rows of every mode (greedy, temperature, top-k,
        top-p, min-p, penalties, logit bias, logprobs, a seed), sampled as a decode graph samples
        (its static rows: cuda_graphs.py) or, with eager_rows, as an eager step does (the rows a view
        into the step's staging copy, batch_prep.prepare_batch's layout: the view's offset moves
        with the step's sizes), and ahead (a verifying step's positions, with and without processed
        scores: model_runner._verify_on_device)."""
        from worker_svc.layers.device_sampler import DeviceSampler
        from worker_svc.layers.sampler import SamplingOptions
        from worker_svc.staging import Staging

        cpu = torch.device("cpu")
        largest = max(DECODE_ROWS)
        sampler = DeviceSampler(vocab, cpu, seed=0, capacity=2 * largest, max_rows=largest)
        for row in range(largest):
            sampler.add(row, [1, 2, 3, 4 + row % 5], 3, SamplingOptions(**SAMPLING_MODES[row % len(SAMPLING_MODES)]))
        sampler.flush()
        last_sampled = torch.zeros(sampler.capacity + 1, dtype=torch.int64)
        static_rows, logprobs = torch.arange(largest), torch.zeros(largest)
        tokens = torch.zeros(largest, dtype=torch.int64)
        staging = Staging(1 << 20, cpu)
        for n in DECODE_ROWS:
            logits = torch.empty(n, vocab, dtype=dtype)   # values never read: nothing runs
            if not eager_rows:
                sampler.sample(logits, static_rows[:n], tokens[:n], logprobs[:n], last_sampled)
                positions = torch.empty(4 * n, vocab, dtype=dtype)   # n rows verifying 3 drafts each
                rows, offsets = torch.arange(n).repeat_interleave(4), torch.arange(4).repeat(n)
                preceding = torch.full((4 * n, 3), -1, dtype=torch.int64)
                out_tokens, out_logprobs = torch.zeros(4 * n, dtype=torch.int64), torch.zeros(4 * n)
                sampler.sample_ahead(positions, rows, offsets, out_tokens, out_logprobs)
                sampler.sample_ahead(positions, rows, offsets, out_tokens, out_logprobs, preceding)
                continue
            for width in (1, 2, 63):
                # An eager decode step's copy: ids, positions, slots, query starts, lengths, logits
                # indices, the device-gathered ids' places and rows, block tables; then the rows
                # that sample (sampling_rows_device).
                ones = np.ones(n, np.int64)
                parts = [ones, ones, ones, np.arange(n + 1), ones, ones, ones, ones, np.ones(n * width, np.int64),
                         np.arange(n)]
                rows = staging.fill(parts)[-1]
                sampler.sample(logits, rows, tokens[:n], logprobs[:n], last_sampled)

    cases = {"sampling": lambda: run(151936, torch.bfloat16, False)}
    # Each costs the finish kernel's compile again (~25 s on 2 cores). Named beside "sampling", the small
    # vocabulary shows the pivot kernel's num_chunks varying: it follows the vocabulary, fixed per model.
    if extended:
        cases["sampling_eager_rows"] = lambda: run(151936, torch.bfloat16, True)
        cases["sampling_vocab512"] = lambda: run(512, torch.bfloat16, False)
    return cases


# --- step inputs: the decode graphs' unpacking (graph_inputs.py), the derivation of a verifying step
# launched ahead (spec_decode/ahead.py) ---------------------------------------------------------------

def _step_input_cases() -> dict[str, Callable[[], None]]:
    import numpy as np
    import torch

    def unpack() -> None:
        """startup.py's DecodeInputs over the staging buffer, unpacking into the decode graphs'
        static inputs (cuda_graphs.py) at each captured batch size."""
        from worker_svc.graph_inputs import DecodeInputs, DecodeLayout

        largest, max_blocks = max(DECODE_ROWS), 2560
        layout = DecodeLayout(max_batch=largest)
        inputs = DecodeInputs(torch.zeros(1 << 20, dtype=torch.int64), layout, torch.zeros(513, dtype=torch.int64),
                              dummy_row=512)
        ids, positions = torch.zeros(largest, dtype=torch.int64), torch.zeros(largest, dtype=torch.int64)
        slots, rows = torch.full((largest,), -1, dtype=torch.int64), torch.zeros(largest, dtype=torch.int64)
        seq_lens = torch.zeros(largest, dtype=torch.int32)
        tables = torch.zeros(largest, max_blocks, dtype=torch.int32)
        for n in DECODE_ROWS:
            inputs.unpack(n, ids[:n], positions[:n], slots[:n], seq_lens[:n], rows[:n], tables[:n])

    def derive() -> None:
        """ahead.prepare_ahead's derivation over views of the step's staging copy (their offsets
        move with the step's sizes), with and without the step before's accepted counts and drafts
        and a drafting plan, for n rows verifying 0..3 drafts each."""
        from worker_svc.spec_decode.ahead import derive as derive_step
        from worker_svc.spec_decode.verification import DeviceLayout, VerifyLayout
        from worker_svc.staging import Staging

        staging = Staging(1 << 20, torch.device("cpu"))
        last_sampled = torch.zeros(513, dtype=torch.int64)
        drafts_buffer = torch.zeros(max(DECODE_ROWS), 3, dtype=torch.int64)   # the drafting graphs' output
        for n in DECODE_ROWS:
            num_drafts = np.arange(n, dtype=np.int64) % 4
            layout = VerifyLayout.build(num_drafts, None)
            tokens = layout.num_positions
            width = 1 + n % 7
            parts = [np.zeros(tokens, np.int64), np.arange(tokens), np.zeros(tokens, np.int64),
                     np.arange(tokens + 1), np.zeros(tokens, np.int64), np.arange(tokens),
                     np.zeros(tokens * width, np.int64), np.arange(n), layout.first, layout.num_drafts, layout.owner,
                     layout.offset, layout.next_drafts, np.arange(tokens), np.arange(n), np.arange(n), np.arange(n),
                     np.zeros(n, np.int64)]
            views = staging.fill(parts)
            ids, positions, slots, _, seq_lens, _, tables = views[:7]
            verify = DeviceLayout(*views[8:13], int(num_drafts.max()))
            token_rows, base, index, rejectable = views[13], views[14], views[15], views[16]
            derive_step(ids, positions, slots, seq_lens, tables, width, 16, verify, token_rows, index, rejectable,
                        None, None, last_sampled, None)
            derive_step(ids, positions, slots, seq_lens, tables, width, 16, verify, token_rows, index, rejectable,
                        views[17], drafts_buffer[:n], last_sampled, base)

    return {"graph_inputs": unpack, "spec_derive": derive}
