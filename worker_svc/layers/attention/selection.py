"""The worker's attention backend, chosen at start-up, and warmed up so that no kernel compiles
after start-up (above all, none during a CUDA-graph capture).

`select_attention_backend("auto", ...)` on CUDA loads each candidate (registry.CUDA_CANDIDATES),
compiles its kernel variants for the model's shapes (warm_up_backend), and times one attention
layer on a few representative steps (measure_backend): decode of one request and of a full
batch, a chunk of a prompt over a cached prefix mixed with decodes, a fresh prompt. Decode is
timed as the worker runs it, by CUDA-graph replay when the backend can be captured; the other
steps eagerly, host overhead included. The backend with the least total time wins. A candidate
that cannot load here (not installed, unsupported GPU), does not take the worker's block size,
cannot read the worker's FP8 KV cache or fails on the model's shapes is skipped with one log line
saying why; when none runs, torch does. On the CPU torch is the only backend. A named backend is
loaded and warmed up as it is, and any failure (a block size or an FP8 cache it cannot take
included) is an error.

All of it is a few seconds (and FlashAttention-4's first compiles, which its disk cache keeps
for the next start). Ranks of a tensor-parallel group measure their own GPUs and then agree
through `reduce_across_ranks` (the runner passes a max over ranks: a step waits for its
slowest rank), so every rank picks the same backend.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from worker_svc.layers.attention.base import AttentionBackend, AttentionMetadata
from worker_svc.layers.attention.kv_quant import FP8_KV_MAX, KVScales, dtype_name, is_fp8, quantize
from worker_svc.layers.attention.registry import CUDA_CANDIDATES, describe_error, get_attention_backend, load_backend
from worker_svc.layers.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

# Context of the measured decodes: about where nano-vllm's bench workload (prompts and outputs
# of 100..1024 tokens) spends its steps.
MEASURE_CONTEXT = 2048
MEASURE_MAX_BATCH = 256
MEASURE_CHUNK = 512
MEASURE_PROMPT = 2048
# The measured steps read their K/V from one shared pool of random blocks, far larger than the
# L2 cache (so reads come from memory, as in serving) yet bounded whatever the batch.
POOL_L2_MULTIPLE = 16
POOL_MIN_BYTES, POOL_MAX_BYTES = 256 << 20, 1 << 30
# Warm-up steps read a small pool: they only have to compile.
WARM_UP_POOL_BLOCKS = 64
WARM_UP_PROMPT = 256
TIMED_CALLS, TIMED_ROUNDS = 10, 3


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention layer and the worker's limits: what a backend is measured and
    warmed up for."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_dtype: torch.dtype | None = None   # None: dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype


@dataclass(frozen=True)
class StepCase:
    name: str
    requests: tuple[tuple[int, int], ...]   # (cached tokens, new tokens) per request

    @property
    def pure_decode(self) -> bool:
        return all(new == 1 for _, new in self.requests)


Step = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]


def synthetic_step(requests: Sequence[tuple[int, int]], shape: AttentionShape, device: torch.device, *,
                   pool_blocks: int | None = None, seed: int = 0) -> Step:
    """(q, k, v, k_cache, v_cache, meta) of a step in which request r has requests[r] = (cached,
    new) tokens, over a cache of random K/V. Each request owns distinct blocks in random order,
    or, with pool_blocks, draws its blocks at random from a pool of that many (bounded memory;
    requests then share blocks, and the new tokens' writes may land on each other)."""
    device = torch.device(device)
    block_size = shape.block_size
    cached = torch.tensor([c for c, _ in requests], dtype=torch.int64)
    new = torch.tensor([n for _, n in requests], dtype=torch.int64)
    seq_lens = cached + new
    blocks = (seq_lens + block_size - 1) // block_size
    width = int(blocks.max())
    gen = torch.Generator().manual_seed(seed)
    if pool_blocks is None:
        num_blocks = int(blocks.sum())
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        table = torch.zeros(len(requests), width, dtype=torch.int32)
        columns = torch.arange(width)
        owned = columns[None, :] < blocks[:, None]
        table[owned] = order
    else:
        num_blocks = pool_blocks
        table = torch.randint(0, pool_blocks, (len(requests), width), generator=gen, dtype=torch.int32)
    query_start = torch.cumsum(new, 0) - new
    rows = torch.repeat_interleave(torch.arange(len(requests)), new)
    positions = torch.arange(int(new.sum())) - query_start[rows] + cached[rows]
    slots = table[rows, positions // block_size].long() * block_size + positions % block_size

    device_gen = torch.Generator(device=device).manual_seed(seed)
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    k_cache, v_cache = (_random_cache(cache_shape, shape, device, device_gen) for _ in range(2))
    num_tokens = int(new.sum())
    q = torch.randn(num_tokens, shape.num_heads, shape.head_dim, generator=device_gen, device=device, dtype=shape.dtype)
    k = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=device_gen, device=device,
                    dtype=shape.dtype)
    v = torch.randn_like(k)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.cat([query_start, new.sum().view(1)]).to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        block_tables=table.to(device),
        max_query_len=int(new.max()), max_seq_len=int(seq_lens.max()),
        query_lens_cpu=new.tolist(), seq_lens_cpu=seq_lens.tolist())
    return q, k, v, k_cache, v_cache, meta


# The synthetic FP8 steps' scales: random normal K/V of unit variance then span e4m3's range.
SYNTHETIC_FP8_SCALE = 4.0 / FP8_KV_MAX


def synthetic_kv_scales(shape: AttentionShape, device: torch.device) -> KVScales | None:
    """The scales synthetic_step's FP8 caches are written with (None for other caches)."""
    if not is_fp8(shape.cache_dtype):
        return None
    scale = torch.full((shape.num_kv_heads,), SYNTHETIC_FP8_SCALE, device=device)
    return KVScales.of(scale, scale)


def _random_cache(cache_shape: tuple[int, ...], shape: AttentionShape, device: torch.device,
                  generator: torch.Generator) -> torch.Tensor:
    values = torch.randn(cache_shape, generator=generator, device=device, dtype=shape.dtype)
    if not is_fp8(shape.cache_dtype):
        return values.to(shape.cache_dtype)
    inverse = synthetic_kv_scales(shape, device).k_inv
    return quantize(values.flatten(0, 1), inverse).view(cache_shape)


def warm_up_cases(shape: AttentionShape, variants: tuple[Sequence[int], Sequence[int]] = ((), ())) -> list[StepCase]:
    """Steps that between them compile every kernel variant a backend needs for this shape:
    decode and prompt steps (which differ in FlashAttention-4's and Triton's specialisation),
    each with one request and with the most the worker takes (FlashAttention-4 compiles another
    scheduler for batches over 256), and a pure-decode and a mixed step at each request count of
    `variants` (the backend's variant_request_counts: its constants chosen by the batch's size)."""
    context = max(1, min(2 * shape.block_size, shape.max_model_len - 1))
    prompt = max(2, min(WARM_UP_PROMPT, shape.max_num_batched_tokens, shape.max_model_len))
    many = shape.max_num_seqs
    cases = [StepCase("decode b=1", ((context, 1),)), StepCase("prompt", ((0, prompt),))]

    def mixed(requests: int) -> StepCase:
        # A short prompt beside decodes, within the token budget.
        decodes = min(requests - 1, max(1, shape.max_num_batched_tokens - 2))
        short_prompt = max(2, min(prompt, shape.max_num_batched_tokens - decodes))
        return StepCase(f"prompt + {decodes} decodes", ((0, short_prompt),) + ((context, 1),) * decodes)

    if many > 1:   # as many rows as a step can have
        cases += [StepCase(f"decode b={many}", ((context, 1),) * many), mixed(many)]
    pure, mixed_counts = variants
    cases += [StepCase(f"decode b={n}", ((context, 1),) * n) for n in pure if 1 < n < many]
    cases += [mixed(n) for n in mixed_counts if 1 < n < many and n - 1 <= shape.max_num_batched_tokens - 2]
    return cases


def measurement_cases(shape: AttentionShape) -> list[StepCase]:
    """The steps the choice is made on (see the module docstring)."""
    context = max(1, min(MEASURE_CONTEXT, shape.max_model_len - 1))
    batch = min(shape.max_num_seqs, MEASURE_MAX_BATCH)
    decodes = min(batch - 1, shape.max_num_batched_tokens // 2)
    chunk = max(1, min(MEASURE_CHUNK, shape.max_num_batched_tokens - decodes, shape.max_model_len - 1))
    prefix = max(0, min(context, shape.max_model_len - chunk))
    prompt = max(1, min(MEASURE_PROMPT, shape.max_num_batched_tokens, shape.max_model_len))
    cases = [StepCase(f"decode b=1 ctx={context}", ((context, 1),))]
    if batch > 1:
        cases.append(StepCase(f"decode b={batch} ctx={context}", ((context, 1),) * batch))
    cases += [StepCase(f"chunk {chunk} over {prefix} + {decodes} decodes",
                       ((prefix, chunk),) + ((context, 1),) * decodes),
              StepCase(f"prompt {prompt}", ((0, prompt),))]
    return cases


def _pool_blocks(shape: AttentionShape, device: torch.device) -> int | None:
    """Blocks of the measurement's shared pool on a GPU (None on the CPU: each request its own)."""
    if device.type != "cuda":
        return None
    block_bytes = 2 * shape.block_size * shape.num_kv_heads * shape.head_dim * shape.cache_dtype.itemsize
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    pool_bytes = min(max(POOL_L2_MULTIPLE * l2_bytes, POOL_MIN_BYTES), POOL_MAX_BYTES,
                     torch.cuda.mem_get_info(device)[0] // 8)
    return max(1, pool_bytes // block_bytes)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(backend: AttentionBackend, step: Step, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
    q, k, v, k_cache, v_cache, meta = step
    return backend.forward(q, k, v, k_cache, v_cache, meta, scale, kv_scales)


def time_per_call(fn: Callable[[], object], device: torch.device, *, calls: int = TIMED_CALLS,
                  rounds: int = TIMED_ROUNDS) -> float:
    """Milliseconds per call of fn, back to back (so a host slower than the device shows), the
    median of `rounds` rounds; CUDA events on a GPU, the wall clock on the CPU."""
    fn()
    results = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            results.append(start.elapsed_time(end) / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            results.append((time.perf_counter() - begin) * 1e3 / calls)
    return statistics.median(results)


def time_step(backend: AttentionBackend, step: Step, scale: float, device: torch.device, *,
              graph: bool, calls: int = TIMED_CALLS, rounds: int = TIMED_ROUNDS,
              kv_scales: KVScales | None = None) -> float:
    """Milliseconds per forward of one layer on `step`: eager, or replaying a CUDA graph of it."""
    if not graph:
        return time_per_call(lambda: run_step(backend, step, scale, kv_scales), device, calls=calls, rounds=rounds)
    run_step(backend, step, scale, kv_scales)   # compiles outside the capture
    _synchronize(device)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        run_step(backend, step, scale, kv_scales)
    try:
        return time_per_call(captured.replay, device, calls=calls, rounds=rounds)
    finally:
        del captured


@torch.inference_mode()
def warm_up_backend(backend: AttentionBackend, shape: AttentionShape, device: torch.device) -> float:
    """Runs every warm_up_cases step once (compiling what is not compiled or cached on disk);
    returns the seconds it took."""
    device = torch.device(device)
    begin = time.perf_counter()
    scale = shape.head_dim ** -0.5
    kv_scales = synthetic_kv_scales(shape, device)
    variants = backend.variant_request_counts(shape.num_kv_heads, shape.max_num_seqs, is_fp8(shape.cache_dtype),
                                              device)
    for i, case in enumerate(warm_up_cases(shape, variants)):
        step = synthetic_step(case.requests, shape, device, pool_blocks=WARM_UP_POOL_BLOCKS, seed=i)
        run_step(backend, step, scale, kv_scales)
        del step
    _synchronize(device)
    return time.perf_counter() - begin


@torch.inference_mode()
def measure_backend(backend: AttentionBackend, shape: AttentionShape, device: torch.device, *,
                    calls: int = TIMED_CALLS, rounds: int = TIMED_ROUNDS) -> dict[str, float]:
    """Milliseconds per layer of each measurement_cases step (decode by CUDA-graph replay where
    the backend can be captured)."""
    device = torch.device(device)
    scale = shape.head_dim ** -0.5
    graphs = device.type == "cuda" and backend.supports_cuda_graphs
    pool_blocks = _pool_blocks(shape, device)
    kv_scales = synthetic_kv_scales(shape, device)
    times = {}
    for i, case in enumerate(measurement_cases(shape)):
        step = synthetic_step(case.requests, shape, device, pool_blocks=pool_blocks, seed=100 + i)
        times[case.name] = time_step(backend, step, scale, device, graph=graphs and case.pure_decode,
                                    calls=calls, rounds=rounds, kv_scales=kv_scales)
        del step
    if device.type == "cuda":   # the buffers go back to the device before the KV cache is sized
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return times


def select_attention_backend(
    requested: str, device: torch.device | str, shape: AttentionShape, *,
    candidates: Sequence[str] = CUDA_CANDIDATES,
    load: Callable[[str], AttentionBackend] = load_backend,
    warm_up: Callable[[AttentionBackend, AttentionShape, torch.device], float] = warm_up_backend,
    measure: Callable[[AttentionBackend, AttentionShape, torch.device], dict[str, float]] = measure_backend,
    reduce_across_ranks: Callable[[list[float]], list[float]] | None = None,
) -> AttentionBackend:
    """The backend the worker runs: `requested` by name ("torch", "triton", "flash_attn"), or
    "auto" (see the module docstring). Returned warmed up. ValueError when a named backend
    cannot run here or fails on this shape."""
    device = torch.device(device)
    if requested != "auto":
        backend = get_attention_backend(requested, device, load=load)
        refusal = backend_refusal(backend, shape)
        if refusal:
            raise ValueError(f"attention backend {requested!r} {refusal}: choose another --attention-backend"
                             + (", or --kv-cache-dtype auto" if is_fp8(shape.cache_dtype) else ""))
        if device.type == "cuda":
            try:
                seconds = warm_up(backend, shape, device)
            except Exception as exc:
                raise ValueError(f"attention backend {requested!r} fails on this model's attention "
                                 f"({shape_summary(shape)}): {describe_error(exc)}") from exc
            logger.info("attention backend %s (as requested): warm-up %.1f s", backend.name, seconds)
        return backend
    if device.type != "cuda":
        return TorchAttentionBackend()

    runnable: dict[str, AttentionBackend] = {}
    totals: dict[str, float] = {}
    for name in candidates:
        try:
            backend = load(name)
        except Exception as exc:
            logger.info("attention backend %s skipped: it cannot load here (%s)", name, describe_error(exc))
            continue
        refusal = backend_refusal(backend, shape)
        if refusal:
            logger.info("attention backend %s skipped: it %s", name, refusal)
            continue
        try:
            seconds = warm_up(backend, shape, device)
            per_case = measure(backend, shape, device)
        except Exception as exc:
            logger.info("attention backend %s skipped: it fails on this model's attention (%s): %s",
                        name, shape_summary(shape), describe_error(exc))
            continue
        runnable[name] = backend
        totals[name] = sum(per_case.values())
        logger.info("attention backend %s: warm-up %.1f s; ms per layer: %s", name, seconds,
                    ", ".join(f"{case} {ms:.3f}" for case, ms in per_case.items()))
    if reduce_across_ranks is not None:   # every rank calls it once, with every candidate, in order
        agreed = reduce_across_ranks([totals.get(name, math.inf) for name in candidates])
        totals = {name: t for name, t in zip(candidates, agreed) if name in runnable and math.isfinite(t)}
    if not totals:
        logger.warning("no accelerated attention backend runs here: attention runs on torch, which is slow")
        return TorchAttentionBackend()
    chosen = min(totals, key=totals.get)
    logger.info("attention backend %s chosen (total ms per layer over the measured steps: %s)", chosen,
                ", ".join(f"{name} {t:.3f}" for name, t in totals.items()))
    return runnable[chosen]


def backend_refusal(backend: AttentionBackend, shape: AttentionShape) -> str | None:
    """Why the backend cannot take the shape's KV cache (its block size, an FP8 cache), or None."""
    if shape.block_size % backend.block_size_multiple:
        return f"takes KV blocks of a multiple of {backend.block_size_multiple} tokens, not {shape.block_size}"
    if is_fp8(shape.cache_dtype) and not backend.reads_fp8_kv:
        return "cannot read an fp8 KV cache"
    return None


def shape_summary(shape: AttentionShape) -> str:
    return (f"{shape.num_heads} heads, {shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, "
            f"{str(shape.dtype).removeprefix('torch.')}, {dtype_name(shape.cache_dtype)} KV cache in blocks of "
            f"{shape.block_size}")
