"""Tensor-parallel rank and size of this process, and the life of its process group.

The whole torch.distributed world is the tensor-parallel group: one worker process per GPU,
all ranks of a worker group run every step. Without an initialised process group the worker
is a single rank (rank 0 of 1), so the parallel layers degrade to plain ones.

A group lives and dies whole. Collectives time out after `timeout_s` (gloo raises; NCCL's
watchdog ends the process), and a heartbeat through the rendezvous store notices a dead peer
while no step runs. Either way the group is marked broken and the worker exits, so that every
rank restarts and they rendezvous afresh: a process group cannot take a restarted rank back.
"""
from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import torch
import torch.distributed as dist

from worker_svc.config import WorkerConfig

logger = logging.getLogger(__name__)

# Ranks start and load their shards at their own pace (one may wait for a GPU, or pull an
# image): waiting for each other may take far longer than any collective should.
RENDEZVOUS_TIMEOUT_S = 600.0
HEARTBEAT_INTERVAL_S = 1.0

_store: dist.Store | None = None
_broken = threading.Event()
_stopping = threading.Event()   # a deliberate shutdown: silence is no longer a failure


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def divide(numerator: int, denominator: int) -> int:
    """Exact division for shard sizes: a remainder means the model cannot be split this way."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def resolve_backend(name: str, device: torch.device) -> str:
    """auto: NCCL between GPUs, gloo between CPU processes."""
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ValueError("the nccl backend needs --device cuda")
    return name


def init_tensor_parallel(config: WorkerConfig) -> None:
    """Joins the group whose rank 0 hosts the rendezvous store at config.dist_init_addr
    (HOST:PORT); returns once every rank has joined, and starts the heartbeat. A no-op for a
    single rank."""
    global _store
    if config.tensor_parallel_size > 1:
        backend = resolve_backend(config.dist_backend, torch.device(config.device))
        _store = _join(config.tensor_parallel_size, config.rank, config.dist_init_addr, backend, config.dist_timeout)
        check_same_settings(_store, config)


# Settings every rank must share: they decide which steps a rank accepts and the shape of its
# work, and ranks that judged a step differently would wait for each other in a collective.
_GROUP_SETTINGS = ("dtype", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                   "load_format", "quantization", "enforce_eager", "attention_backend", "kv_cache_dtype",
                   "speculative_method", "num_speculative_tokens", "speculative_graph_batch_size")


def check_same_settings(store: dist.Store, config: WorkerConfig) -> None:
    """Rank 0 posts its settings in the store; every other rank compares its own with them."""
    mine = json.dumps({name: getattr(config, name) for name in _GROUP_SETTINGS}, sort_keys=True)
    if config.rank == 0:
        store.set("settings", mine)
    theirs = store.get("settings").decode()
    if theirs != mine:
        raise ValueError(f"rank {config.rank} runs with {mine}, rank 0 with {theirs}: start every rank "
                         "with the same settings")


def _join(world_size: int, rank: int, init_addr: str, backend: str, timeout_s: float) -> dist.Store:
    host, _, port = init_addr.rpartition(":")
    logger.info("rank %d of %d: joining the %s group at %s", rank, world_size, backend, init_addr)
    store = dist.TCPStore(host.strip("[]"), int(port), world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S), wait_for_workers=False)
    # Each rank counts itself in. A count past world_size means this rank reached a store
    # whose group is still running (its rank 0 has not noticed a dead peer yet): give up and
    # let the restart find a fresh one.
    if store.add("joined", 1) > world_size:
        raise RuntimeError(f"the group at {init_addr} already has {world_size} ranks; is an old rank 0 still running?")
    _store_barrier(store, "joined", world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    threading.Thread(target=_heartbeat, args=(store, rank, world_size, timeout_s), daemon=True,
                     name="tp-heartbeat").start()
    logger.info("rank %d of %d: group ready", rank, world_size)
    return store


def barrier(name: str) -> None:
    """Waits, up to RENDEZVOUS_TIMEOUT_S, until every rank arrives here: before the first
    collective after slow, uneven work (loading weights), which the collective timeout would
    not allow for. A no-op on a single rank or a group this module did not start."""
    if _store is not None:
        _store_barrier(_store, name, get_tp_size())


def _store_barrier(store: dist.Store, name: str, world_size: int) -> None:
    """A barrier a name may serve again: every world_size arrivals under it make one round."""
    arrived = store.add(f"arrived/{name}", 1)
    done = f"all/{name}/{(arrived - 1) // world_size}"
    if arrived % world_size == 0:
        store.set(done, "1")
    store.wait([done])


def _heartbeat(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Ranks > 0 tick a counter in rank 0's store (which fails once rank 0 is gone); rank 0
    watches that every counter moves within timeout_s."""
    last_count = [0] * world_size
    last_seen = [time.monotonic()] * world_size
    while not _stopping.wait(HEARTBEAT_INTERVAL_S) and not _broken.is_set():
        try:
            if rank != 0:
                store.add(f"heartbeat/{rank}", 1)
                continue
            now = time.monotonic()
            for peer in range(1, world_size):
                count = store.add(f"heartbeat/{peer}", 0)   # adding 0 reads the counter
                if count != last_count[peer]:
                    last_count[peer], last_seen[peer] = count, now
                elif now - last_seen[peer] > timeout_s:
                    mark_broken(f"rank {peer} sent no heartbeat for {timeout_s:.0f} s")
        except Exception as exc:   # the store's connection to rank 0 broke
            mark_broken(f"rank 0 is unreachable: {exc}")


def mark_broken(reason: str) -> None:
    """The group can run no more collectives (a peer died, or a step failed half-way)."""
    if not _broken.is_set():
        logger.error("tensor-parallel group broken: %s", reason)
        _broken.set()


def group_broken() -> threading.Event:
    return _broken


def all_reduce_min(value: int, device: torch.device) -> int:
    if get_tp_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum of every rank's values (the values themselves on a single rank)."""
    if get_tp_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def broadcast_tokens(token_ids: torch.Tensor | None, count: int, device: torch.device) -> torch.Tensor:
    """Rank 0's sampled token ids (int64, on the device), on every rank; the others pass None
    and the count they expect. On CUDA the broadcast is enqueued, not waited for."""
    if get_tp_size() == 1:
        return token_ids
    if get_tp_rank() != 0:
        token_ids = torch.empty(count, dtype=torch.int64, device=device)
    dist.broadcast(token_ids, src=0)
    return token_ids


def destroy_tensor_parallel() -> None:
    global _store
    _stopping.set()
    if _distributed():
        dist.destroy_process_group()
    _store = None
