"""The most one step may hold on this worker, when --max-num-batched-tokens is unset: a token
budget that fits the device. The worker warms up for the budget, reports it (and max_num_seqs)
in WorkerInfo, and a scheduler without limits of its own schedules within what its workers report,
so the two sides share one number. Importing this module imports no torch (the flags' help reads it).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from worker_svc.config import WorkerConfig

GIB = 1 << 30
CPU_MAX_NUM_BATCHED_TOKENS = 2048
# (device memory from, tokens per step), largest first: the warm-up forward of a step this size
# takes ~1-2 GiB of activations on an 8B model, small beside the KV cache on such a device.
CUDA_MAX_NUM_BATCHED_TOKENS = ((64 * GIB, 16384), (24 * GIB, 8192), (0, 4096))
# Requests held at once per slot of max_num_seqs: a running one and a paused one (which keeps its
# mirror). Reported as WorkerInfo.max_held_requests; the scheduler drops paused mirrors past it.
HELD_PER_SEQ_SLOT = 2


def default_max_num_batched_tokens(device_type: str, total_memory: int) -> int:
    """The token budget of a step on a device of this type and memory (bytes)."""
    if device_type != "cuda":
        return CPU_MAX_NUM_BATCHED_TOKENS
    return next(tokens for memory, tokens in CUDA_MAX_NUM_BATCHED_TOKENS if total_memory >= memory)


def describe_defaults() -> str:
    """The defaults in words, for --help."""
    cuda = ", ".join(f"{tokens} from {memory // GIB} GiB" if memory else f"else {tokens}"
                     for memory, tokens in CUDA_MAX_NUM_BATCHED_TOKENS)
    return f"{CPU_MAX_NUM_BATCHED_TOKENS} on the CPU; on CUDA by device memory: {cuda}"


def with_step_limits(config: WorkerConfig, device: torch.device) -> WorkerConfig:
    """`config` with its unset step budget set for `device`."""
    if config.max_num_batched_tokens is not None:
        return config
    import torch

    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return dataclasses.replace(config, max_num_batched_tokens=default_max_num_batched_tokens(device.type, memory))
