"""A model runner's start-up, in the order ModelRunner.__init__ calls it: the device and the
dtype, the attention backend (named, or the fastest here by measurement), the model and its
weights, the KV cache's size (on a GPU after one warm-up step at the largest step the worker
takes, so the memory profile sees the activation peak), and the CUDA graphs of the decode
forward once the cache they read exists. Nothing here runs after the first step.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import pathlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from worker_svc import kv_cache, parallel_state
from worker_svc.config import WorkerConfig
from worker_svc.layers.attention import (AttentionBackend, AttentionShape, configure_kernel_cache,
                                         select_attention_backend)
from worker_svc.layers.sampler import SamplingOptions
from worker_svc.kv_cache_scales import bind_kv_scales
from worker_svc.layers.fp8 import DEFAULT_BLOCK, has_fp8_tensor_cores
from worker_svc.layers.moe import FusedExperts
from worker_svc.loader import init_dummy_weights, load_safetensors, safetensors_files
from worker_svc.models import build_model
from worker_svc.parallel_state import all_reduce_max, all_reduce_min, get_tp_rank, get_tp_size
from worker_svc.runner_io import NewRequest, StepInput
from worker_svc.spec_decode.ahead import warm_up_derive
from worker_svc.spec_decode.verification import decode_rows

if TYPE_CHECKING:
    from worker_svc.cuda_graphs import DecodeGraphs
    from worker_svc.mixed_graphs import MixedGraphs
    from worker_svc.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


def resolve_device(name: str) -> torch.device:
    """The device named, made current when it is a GPU ("cuda" alone: the current one, by index)."""
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def tensor_parallel_rank(config: WorkerConfig) -> tuple[int, int]:
    """(rank, size) of this worker in its group; ValueError when the process group disagrees
    with the configuration."""
    rank, size = get_tp_rank(), get_tp_size()
    if (rank, size) != (config.rank, config.tensor_parallel_size):
        raise ValueError(f"configured as rank {config.rank} of {config.tensor_parallel_size}, but the process "
                         f"group makes this rank {rank} of {size}")
    return rank, size


def resolve_dtype(name: str, device: torch.device, model_config) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32    # CPU half-precision matmuls are slow and the reference is float32
    checkpoint = getattr(model_config, "dtype", None) or torch.bfloat16
    return getattr(torch, checkpoint) if isinstance(checkpoint, str) else checkpoint


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def select_backend(runner: ModelRunner) -> AttentionBackend:
    """The configured backend, or the fastest on this device for this model's attention
    (every rank of a group agrees on one), warmed up before the memory profile and capture."""
    config = runner.config
    configure_kernel_cache(config.kernel_cache_dir)
    shape = AttentionShape(
        num_heads=runner.model_config.num_attention_heads // runner.tp_size, num_kv_heads=runner.num_kv_heads,
        head_dim=runner.head_dim, dtype=runner.dtype, block_size=runner.block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=runner.max_model_len, kv_cache_dtype=runner.kv_cache_dtype)

    return select_attention_backend(config.attention_backend, runner.device, shape,
                                    reduce_across_ranks=_slowest_rank(runner, "attention measured"))


def _slowest_rank(runner: ModelRunner, name: str) -> Callable[[list[float]], list[float]] | None:
    """For a start-up choice the ranks of a group must agree on: every rank's measured times
    reduced to their element-wise maximum (so each rank chooses what the slowest measured), after
    a barrier (first compiles take uneven time); None on a single rank."""
    if runner.tp_size == 1:
        return None

    def agree(times: list[float]) -> list[float]:
        parallel_state.barrier(name)
        return all_reduce_max(times, runner.device)
    return agree


def quantize_lm_head(model: torch.nn.Module, device: torch.device) -> None:
    """The LM head's weight in block FP8 (--lm-head-dtype fp8), in the checkpoint's blocks or 128 x 128:
    computed from by the FP8 kernels where the device has FP8 tensor cores, else as their dequantized values
    (docs/PERF_NOTES.md v43)."""
    quant = getattr(model, "quant_config", None)
    block = quant.block if quant is not None else DEFAULT_BLOCK
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    shared = embedding is not None and model.lm_head.weight is embedding.weight   # tie_word_embeddings
    model.lm_head.quantize_fp8(block, has_fp8_tensor_cores(device), shared)
    logger.info("lm_head in FP8 (%dx%d blocks%s): --lm-head-dtype fp8", *block,
                ", beside the bf16 embedding it is tied to" if shared else "")


def load_model(runner: ModelRunner, model_dir: pathlib.Path) -> torch.nn.Module:
    """The model on the runner's device and dtype, with the checkpoint's weights (or random
    ones for --load-format dummy); every rank has loaded when it returns."""
    config, model_config = runner.config, runner.model_config
    with torch.device(runner.device), default_dtype(runner.dtype):
        model = build_model(model_config, runner.backend, runner.max_model_len, config.quantization,
                            runner.device).eval()
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed, std=model_config.initializer_range)
    else:
        load_safetensors(model, model_dir)
    bind_kv_scales(model, runner.kv_cache_dtype, [] if config.load_format == "dummy" else safetensors_files(model_dir))
    if config.lm_head_dtype == "fp8":
        quantize_lm_head(model, runner.device)
    parallel_state.barrier("loaded")   # ranks load at their own pace; collectives follow
    if runner.device.type == "cuda":   # each linear layer's fastest kernel by row count (imports Triton)
        from worker_svc.layers.linear_selection import select_linear_methods
        from worker_svc.layers.moe_selection import select_fp8_modes

        reduce = _slowest_rank(runner, "kernels measured")   # the ranks run the same kernels
        select_linear_methods(model, runner.device, runner.dtype, max_rows=config.max_num_batched_tokens,
                              reduce_across_ranks=reduce)
        select_fp8_modes(model, runner.device, runner.dtype, max_tokens=config.max_num_batched_tokens,
                         reduce_across_ranks=reduce)
    return model


def size_kv_cache(runner: ModelRunner) -> int:
    """KV blocks: as configured, or what the memory left after a warm-up holds (a GPU), or the
    CPU default; the same on every rank of the group."""
    config = runner.config
    per_block = kv_cache.block_bytes(runner.model_config.num_hidden_layers, runner.block_size, runner.num_kv_heads,
                                     runner.head_dim, runner.kv_cache_dtype)
    reserved = 0
    if runner.drafter is not None:   # its cache has a block beside each of the target's, and scratch blocks
        per_block += runner.drafter.block_bytes()
        reserved = -(-runner.drafter.scratch_bytes() // per_block)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_gb is not None:
        num_blocks = kv_cache.blocks_for_memory(config.kv_cache_memory_gb, per_block) - reserved
    elif runner.device.type == "cuda":
        warm_up(runner)
        num_blocks = kv_cache.cuda_free_blocks(runner.device, per_block, config.gpu_memory_utilization) - reserved
    else:
        num_blocks = kv_cache.cpu_default_blocks(per_block)
    # The scheduler hands out one set of block ids for the whole group: every rank holds
    # as many blocks as the tightest one can.
    num_blocks = all_reduce_min(num_blocks, runner.device)
    if num_blocks < 1:
        raise ValueError(f"no memory left for the KV cache (a block takes {per_block} bytes)")
    return num_blocks


def warm_up(runner: ModelRunner) -> None:
    """One step at max_num_batched_tokens and one sampling of max_num_seqs rows (with top-k, top-p
    and min-p), through a temporary KV cache, so the memory profile sees the activation peak.
    Leaves the runner empty and the device's cache allocator flushed."""
    config, device = runner.config, runner.device
    seq_len = min(config.max_num_batched_tokens, runner.max_model_len)
    num_seqs = max(min(config.max_num_batched_tokens // seq_len, config.max_num_seqs), 1)
    blocks_per_seq = -(-seq_len // runner.block_size)
    kv_cache.allocate_kv_cache(runner.model, num_seqs * blocks_per_seq, runner.block_size,
                               runner.num_kv_heads, runner.head_dim, runner.kv_cache_dtype, device)
    if runner.drafter is not None:
        runner.drafter.allocate_kv_cache(num_seqs * blocks_per_seq)
    warm_options = SamplingOptions(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)
    new_requests = [NewRequest(-1 - i, [0] * seq_len, seq_len, 0, seq_len,
                               list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), warm_options)
                    for i in range(num_seqs)]
    empty = np.zeros(0, np.int64)
    # A proposer on the device runs only in steps that ask for drafts: this one does, so it is profiled.
    warm = StepInput(0, [], new_requests, [], empty, empty, empty, empty, propose_drafts=runner.drafter is not None)
    torch.cuda.reset_peak_memory_stats(device)
    runner.run_unchecked(warm)
    logits = torch.zeros(config.max_num_seqs, runner.vocab_size, device=device, dtype=runner.dtype)
    if runner.sampler is not None:
        runner.sampler.sample_rows(logits, [_WarmRow(warm_options)] * config.max_num_seqs)
    if runner.device_sampler is not None:   # the padding's dummy row: compiles the kernels
        rows = torch.full((config.max_num_seqs,), runner.device_sampler.dummy_row, device=device)
        runner.device_sampler.sample(logits, rows, runner._tokens, runner._logprobs, runner.last_sampled)
    warm_up_derive(runner)   # a verifying step launched ahead derives its inputs with it (spec_decode/ahead.py)
    runner.reset()
    kv_cache.unbind_kv_cache(runner.model)
    if runner.drafter is not None:
        runner.drafter.release_kv_cache()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


@dataclass
class _WarmRow:
    """A sampler row as the warm-up's sampling sees it."""
    sampling: SamplingOptions
    penalty_row: int | None = None
    num_output_tokens: int = 0


def decode_graph_tokens(max_num_seqs: int, num_speculative_tokens: int, speculative_graph_batch_size: int) -> int:
    """Tokens the largest decode graph holds: every request of a step, and, when speculating, a
    verifying step of up to the speculative graph batch, whose every token is a decode row (1 + K
    per request); fewer, and such steps run eagerly."""
    if not num_speculative_tokens:
        return max_num_seqs
    return max(max_num_seqs, decode_rows(min(max_num_seqs, speculative_graph_batch_size), num_speculative_tokens))


def capture_mixed_graphs(runner: ModelRunner) -> MixedGraphs | None:
    """CUDA graphs of the forward of steps that are not pure decode (mixed_graphs.py), where the
    device, the backend and the model allow them and the memory holds them; after the decode graphs."""
    from worker_svc import mixed_graphs

    if runner.device.type != "cuda" or runner.config.enforce_eager or not mixed_graphs.ENABLED:
        return None
    why_not = None
    if not runner.backend.supports_mixed_graphs:
        why_not = f"attention backend {runner.backend.name} reads host lengths in mixed steps"
    elif runner.proposer is not None:
        why_not = "a speculating worker's steps verify drafts"
    elif runner.tp_size > 1:   # the warm-ups and the check run collectives: every rank must capture, or none
        why_not = "a rank of a tensor-parallel group that could not capture them would leave the others waiting"
    elif any(isinstance(module, FusedExperts) for module in runner.model.modules()):
        # A padding token's row carries garbage (mixed_graphs.py): its routing would pick experts from it.
        why_not = "an MoE model's router would route the padding tokens' garbage"
    if why_not is not None:
        logger.info("prefill and mixed steps launch eagerly: %s", why_not)
        return None
    start = time.perf_counter()
    graphs = failure = None
    try:
        graphs = mixed_graphs.MixedGraphs(runner.model, max_tokens=runner.config.max_num_batched_tokens,
                                          max_requests=runner.config.max_num_seqs,
                                          max_blocks_per_seq=runner.max_blocks_per_seq,
                                          max_model_len=runner.max_model_len, device=runner.device)
    except torch.cuda.OutOfMemoryError as exc:   # (its frames, and the graphs captured so far, go with it)
        failure = f"no device memory left for them ({exc})"
    except RuntimeError as exc:   # a capture the driver refused: the steps run as they did without
        failure = f"their capture failed ({exc!r})"
    if graphs is None:
        torch.cuda.empty_cache()
        logger.warning("the mixed steps' CUDA graphs are off, such steps launch eagerly: %s", failure)
        return None
    # Their check needs 9 blocks at most (block size 1) and a 6-token step.
    error = (graphs.replay_error(runner.block_size, runner.vocab_size)
             if runner.num_kv_blocks >= 9 and graphs.sizes[-1] >= 6 else 0.0)
    # Rounding only: the padded matmuls may take other kernels (16-bit: ~1e-3; a wrong replay: ~1).
    tolerance = 1e-4 if runner.dtype == torch.float32 else 5e-2
    if not error <= tolerance:
        logger.error("the mixed steps' CUDA graphs replay a test step %.2e away from the eager forward (tolerance "
                     "%.0e): they are off, and such steps launch eagerly", error, tolerance)
        return None
    logger.info("captured %d graphs of prefill and mixed steps (%d..%d tokens, up to %d requests) in %.1f s",
                len(graphs.graphs), graphs.sizes[0], graphs.sizes[-1], graphs.max_requests,
                time.perf_counter() - start)
    return graphs


def capture_decode_graphs(runner: ModelRunner) -> DecodeGraphs | None:
    """CUDA graphs of the decode forward, where the device and the backend allow them."""
    if runner.device.type != "cuda" or runner.config.enforce_eager:
        return None
    if not runner.backend.supports_cuda_graphs:
        logger.info("attention backend %s cannot be captured: decoding eagerly", runner.backend.name)
        return None
    from worker_svc.cuda_graphs import DecodeGraphs   # CUDA only
    from worker_svc.graph_inputs import DecodeInputs

    start = time.perf_counter()
    inputs = sample = sample_key = None
    # The step's inputs staged for the graph, and the sampling in one (a speculating worker samples
    # outside the graphs: a verification samples every position, then accepts).
    if runner.device_sampler is not None:
        inputs = DecodeInputs(runner._staging.on_device, runner._decode_layout, runner.last_sampled,
                              runner.device_sampler.dummy_row)
        if runner.bookkeeping is None:
            sample, sample_key = runner.sample_in_graph, runner.device_sampler.graph_key
    forward = runner.model
    if runner.drafter is not None and runner.drafter.aux_layers:   # eagle3 reads them in the steps that draft
        forward = functools.partial(runner.model, aux_layers=runner.drafter.aux_layers)
    graphs = DecodeGraphs(forward, max_batch_size=runner.graph_tokens,
                          max_blocks_per_seq=runner.max_blocks_per_seq, max_model_len=runner.max_model_len,
                          device=runner.device, inputs=inputs, sample=sample, sample_key=sample_key)
    logger.info("captured %d decode graphs%s in %.1f s", len(graphs.graphs),
                " with the sampling in graphs of their own" if sample else "", time.perf_counter() - start)
    if runner.drafter is not None:
        start = time.perf_counter()
        runner.drafter.capture_graphs(runner, graphs)
        logger.info("captured the %s proposer's graphs (catch-up %d, drafting %d) for steps of up to %d requests "
                    "in %.1f s", runner.drafter.method, len(runner.drafter.catch_up_graphs.graphs),
                    len(runner.drafter.drafting_graphs.graphs), runner.config.speculative_graph_batch_size,
                    time.perf_counter() - start)
    return graphs
