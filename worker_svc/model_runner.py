"""Runs engine steps: keeps the persistent batch, builds each step's inputs, runs the model and
samples. The scheduler decides everything; this validates what it is told and executes it.

A step is launched, then awaited (`launch(step).result()`): launching validates and applies the
step, prepares its inputs with vectorised host work and one host-to-device copy, and enqueues the
forward and the sampling on the device; the sampled tokens are copied back behind an event.
`result()` waits for that event. So a caller that launches step N+1 right after N (the gRPC
server does, from another thread) prepares N+1 while the device still runs N, and N+1's decode
inputs are N's sampled tokens, gathered on the device from the rows' newest token.

What only some requests ask for costs only the steps that hold such requests: a grammar's token
mask (worker_svc/structured_output.py: the one place a step waits for the step before it), the
top logprobs of sampled tokens and the scores of prompt tokens (worker_svc/layers/logprobs.py).
"""
from __future__ import annotations

import contextlib
import logging
import pathlib
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from common.constraint import Constraint
from common.features import check_features
from common.model_dir import read_model_facts
from common.pb.llm.worker.v1 import worker_pb2
from worker_svc import kv_cache, parallel_state
from worker_svc.config import WorkerConfig
from worker_svc.input_batch import InputBatch
from worker_svc.layers.attention import (AttentionMetadata, AttentionShape, configure_kernel_cache,
                                         select_attention_backend)
from worker_svc.layers.logprobs import score_tokens, top_logprobs
from worker_svc.layers.sampler import Sampler, SamplingMetadata, SamplingOptions
from worker_svc.loader import init_dummy_weights, load_safetensors
from worker_svc.model_config import load_model_config
from worker_svc.models import build_model
from worker_svc.models.qwen3 import head_dim_of
from worker_svc.parallel_state import all_reduce_max, all_reduce_min, broadcast_tokens, get_tp_rank, get_tp_size
from worker_svc.step_message import (InvalidStepError, NewRequest, PromptLogprobs, RequestFailure, StaleMirrorError,
                                     StepInput, StepOutput, TopLogprobs)
from worker_svc.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "InvalidStepError", "StaleMirrorError", "PendingStep"]

_DEFAULT_BLOCK_SIZE = 16
_NONE = np.zeros(0, np.int64)   # an empty staging part
# Launched steps whose tokens may not be read yet: the server has at most two (the one whose
# reply is awaited and the one launched behind it); more slots only add slack.
_OUTPUT_SLOTS = 4


@dataclass
class StepBatch:
    """A launched step's device inputs and the host facts the sampling needs."""
    input_ids: torch.Tensor         # int64 [num_tokens]
    positions: torch.Tensor         # int64 [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor    # int64 [num_sampling]: the last token of each sampling request
    sampling_rows: np.ndarray       # rows that sample, in batch order (host)
    sampling_rows_device: torch.Tensor
    seeded_output_indices: list[int]   # the output index each seeded sampling row draws
    # Sampling positions whose rows have a grammar matcher, the matchers, and the positions on the device.
    constrained: tuple[list[int], list, torch.Tensor] | None = None
    # Top logprobs: each sampling position's k (0: not asked), and the positions that asked (device).
    top_ks: np.ndarray | None = None
    top_positions: torch.Tensor | None = None
    # Prompt scoring: flat token indices and the prompt tokens they predict (device), and per
    # scored request (seq_id, first position scored, count, k).
    score_indices: torch.Tensor | None = None
    score_targets: torch.Tensor | None = None
    scored: list[tuple[int, int, int, int]] | None = None


def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Starts the copy of a device tensor to the host (finished by the step's event)."""
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    return tensor.to("cpu", non_blocking=True)


@dataclass
class _Logprobs:
    """A step's top and prompt logprobs on their way to the host, and what their rows asked."""
    top_ks: np.ndarray | None = None                 # per sampled token
    top_ids: torch.Tensor | None = None              # [asked, max k]
    top_values: torch.Tensor | None = None
    scored: list[tuple[int, int, int, int]] | None = None
    scores: torch.Tensor | None = None               # [scored tokens]
    score_top_ids: torch.Tensor | None = None        # [scored tokens, max k]
    score_top_values: torch.Tensor | None = None

    def top(self) -> TopLogprobs | None:
        if self.top_ks is None:
            return None
        ks = self.top_ks.tolist()
        return _columns(ks, [k for k in ks if k], self.top_ids.tolist(), self.top_values.tolist())

    def prompt(self) -> PromptLogprobs | None:
        if self.scored is None or self.scores is None:
            return None
        seq_ids, firsts, counts, ks = (list(column) for column in zip(*self.scored))
        top = None
        if self.score_top_ids is not None:
            token_ks = [k for k, count in zip(ks, counts) for _ in range(count)]
            top = _columns(token_ks, token_ks, self.score_top_ids.tolist(), self.score_top_values.tolist())
        return PromptLogprobs(seq_ids, firsts, counts, self.scores.tolist(), top)


def _columns(counts: list[int], row_ks: list[int], ids: list[list[int]], values: list[list[float]]) -> TopLogprobs:
    """Packs rows of the max k (row i keeping its first row_ks[i]) into columns with `counts`."""
    flat_ids, flat_values = [], []
    for k, row_ids, row_values in zip(row_ks, ids, values):
        flat_ids += row_ids[:k]
        flat_values += row_values[:k]
    return TopLogprobs(counts, flat_ids, flat_values)


class PendingStep:
    """A launched step; result() waits (without the interpreter lock) for its tokens."""

    def __init__(self, step_id: int, started: float, prepare_ms: float, forward_ms: float, num_sampled: int,
                 tokens: torch.Tensor | None, logprobs: torch.Tensor | None, event, release,
                 device_start=None, extra: _Logprobs | None = None) -> None:
        self.step_id = step_id
        self._started = started
        self._prepare_ms, self._forward_ms = prepare_ms, forward_ms
        self._num_sampled = num_sampled
        self._tokens, self._logprobs, self._event, self._release = tokens, logprobs, event, release
        self._device_start = device_start
        self._extra = extra
        self.failed: list[RequestFailure] = []     # requests given up on in this step

    def result(self) -> StepOutput:
        try:
            if self._event is not None:
                self._event.synchronize()
            n = self._num_sampled
            tokens = self._tokens[:n].tolist() if n else []
            logprobs = self._logprobs[:n].tolist() if self._logprobs is not None and n else None
            extra = self._extra
            top = extra.top() if extra is not None else None
            prompt = extra.prompt() if extra is not None else None
        finally:
            if self._release is not None:
                self._release()
                self._release = None
        device_ms = self._device_start.elapsed_time(self._event) if self._device_start is not None else 0.0
        return StepOutput(self.step_id, tokens, logprobs, self._prepare_ms, self._forward_ms,
                          (time.perf_counter() - self._started) * 1e3, device_ms, top, prompt, tuple(self.failed))


class _OutputSlots:
    """Pinned host buffers the device copies sampled tokens into, one per launched step whose
    result is not read yet, so step N+1's copy never lands on N's before N's reply reads it."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.tokens = [torch.empty(capacity, dtype=torch.int64, pin_memory=pin) for _ in range(_OUTPUT_SLOTS)]
        self.logprobs = [torch.empty(capacity, dtype=torch.float32, pin_memory=pin) for _ in range(_OUTPUT_SLOTS)]
        self._free = list(range(_OUTPUT_SLOTS))
        self._cond = threading.Condition()

    def acquire(self) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._free)
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()


class _Staging:
    """One host buffer per step holding every integer input, copied to the device in one go.
    Two pinned buffers alternate; the host waits for a buffer's last copy before refilling it
    (with at most two steps launched ahead, it never does in practice)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2 if self.cuda else 1)]
        self.events = [None] * len(self.host)
        self.on_device = torch.empty(capacity, dtype=torch.int64, device=device) if self.cuda else None
        self._next = 0

    def fill(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Copies the parts to the device in one transfer; returns device views of each."""
        i = self._next
        self._next = (i + 1) % len(self.host)
        if self.events[i] is not None:
            self.events[i].synchronize()
        host = self.host[i]
        view = host.numpy()
        sizes = [len(p) for p in parts]
        offset = 0
        for part, size in zip(parts, sizes):
            view[offset:offset + size] = part
            offset += size
        if self.cuda:
            self.on_device[:offset].copy_(host[:offset], non_blocking=True)
            event = self.events[i] or torch.cuda.Event()
            event.record()
            self.events[i] = event
            flat = self.on_device
        else:
            flat = host[:offset].clone()
        views, offset = [], 0
        for size in sizes:
            views.append(flat[offset:offset + size])
            offset += size
        return views


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def resolve_dtype(name: str, device: torch.device, model_config) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32    # CPU half-precision matmuls are slow and the reference is float32
    checkpoint = getattr(model_config, "dtype", None) or torch.bfloat16
    return getattr(torch, checkpoint) if isinstance(checkpoint, str) else checkpoint


class ModelRunner:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:   # "cuda": the current device, named by its index
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if (self.tp_rank, self.tp_size) != (config.rank, config.tensor_parallel_size):
            raise ValueError(f"configured as rank {config.rank} of {config.tensor_parallel_size}, but the process "
                             f"group makes this rank {self.tp_rank} of {self.tp_size}")
        model_dir = pathlib.Path(config.model)
        facts = read_model_facts(model_dir)
        self.model_name = facts.name
        self.model_config = model_config = load_model_config(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.block_size = config.block_size or _DEFAULT_BLOCK_SIZE
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.vocab_size = model_config.vocab_size
        self.num_kv_heads = model_config.num_key_value_heads // self.tp_size
        self.head_dim = head_dim_of(model_config)
        self.backend = self._select_attention_backend()

        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = build_model(model_config, self.backend, self.max_model_len, config.quantization,
                                     self.device).eval()
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed, std=model_config.initializer_range)
        else:
            load_safetensors(self.model, model_dir)
        parallel_state.barrier("loaded")   # ranks load at their own pace; collectives follow
        # Rank 0 alone samples (and keeps penalty state); the others take its tokens.
        self.sampler = Sampler(self.vocab_size, self.device, config.seed) if self.tp_rank == 0 else None
        self.features = check_features()
        self.structured = (StructuredOutput(model_dir, self.vocab_size, facts.eos_token_ids, self.device,
                                            feature=self.features[0], compile_timeout_s=config.grammar_compile_timeout,
                                            compile_processes=config.grammar_compile_processes,
                                            mask_budget_ms=config.max_mask_ms)
                           if self.tp_rank == 0 else None)
        if self.structured is not None:   # CUDA: beside the graph capture; CPU: now, before any step
            self.structured.load_in_background() if self.device.type == "cuda" else self.structured.load()
        self.batch = InputBatch(self.max_model_len, self.max_blocks_per_seq, initial_rows=config.max_num_seqs)
        self._sampling_cache: tuple[tuple[int, bytes], SamplingMetadata] | None = None
        max_tokens, max_seqs = config.max_num_batched_tokens, config.max_num_seqs
        # The step's integer inputs: input ids, positions and slots per token; query starts,
        # lengths and block tables per request; logits indices, sampling rows and the decode
        # tokens to gather per sampling request; constrained and top-logprob positions among
        # them; prompt tokens to score and their targets.
        self._staging = _Staging(5 * max_tokens + max_seqs * (self.max_blocks_per_seq + 8) + 1, self.device)
        self._outputs = _OutputSlots(max_seqs, self.device)
        # Each row's newest sampled token, on the device: the next decode's input.
        self.last_sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.decode_graphs = None   # captured below, once the KV cache they read exists
        self.num_kv_blocks = self._size_kv_cache()
        self.kv_cache = kv_cache.allocate_kv_cache(self.model, self.num_kv_blocks, self.block_size,
                                                   self.num_kv_heads, self.head_dim, self.dtype, self.device)
        self.decode_graphs = self._capture_decode_graphs()
        self.instance_id = uuid.uuid4().hex
        logger.info(
            "model %s on %s (%s, attention %s): %d KV blocks of %d tokens, max_model_len %d",
            self.model_name, self.device, str(self.dtype).removeprefix("torch."), self.backend.name,
            self.num_kv_blocks, self.block_size, self.max_model_len,
        )

    # --- public API ------------------------------------------------------------------------

    def describe(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            model=self.model_name,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            rank=self.tp_rank,
            world_size=self.tp_size,
            device=str(self.device),
            attention_backend=self.backend.name,
            dtype=str(self.dtype).removeprefix("torch."),
            instance_id=self.instance_id,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            features=[worker_pb2.Feature(name=f.name, available=f.available, detail=f.detail) for f in self.features],
        )

    def step(self, step: StepInput) -> StepOutput:
        """Runs one step to the end: launch(step).result()."""
        return self.launch(step).result()

    def launch(self, step: StepInput) -> PendingStep:
        """Validates and applies the step and enqueues its forward and sampling; returns at once
        on a device that runs asynchronously. Raises InvalidStepError (a ValueError), before
        changing any state, when the step contradicts itself, the worker's limits or its batch.
        Every rank of a tensor-parallel group runs the same steps in the same order; only rank
        0's tokens are the answer."""
        started = time.perf_counter()
        if parallel_state.group_broken().is_set():
            raise RuntimeError("the tensor-parallel group is broken; this worker is exiting")
        cached_rows, matchers, failed = self._validate(step)
        rows, counts = self._apply(step, cached_rows, matchers)
        if not len(rows):
            pending = PendingStep(step.step_id, started, 0.0, 0.0, 0, None, None, None, None)
        else:
            batch = self._prepare(rows, counts)
            prepared = time.perf_counter()
            try:
                pending = self._execute(step.step_id, batch, started, (prepared - started) * 1e3)
            except Exception as exc:
                if self.tp_size > 1:   # the other ranks are left waiting in a collective
                    parallel_state.mark_broken(f"step {step.step_id} failed: {exc!r}")
                raise
        pending.failed += failed
        return pending

    def prepare_grammar(self, constraint: Constraint) -> None:
        """Compiles a constraint before its request's first step (StructuredOutput.prepare)."""
        if self.structured is None:
            raise InvalidStepError("only rank 0 of a group prepares grammars")
        self.structured.prepare(constraint)

    def reset(self) -> None:
        for seq_id in self.batch.seq_ids():
            self._drop(seq_id)
        if self.structured is not None:
            self.structured.clear()

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every token of the batch; pure-decode batches replay a CUDA graph."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            return self.decode_graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta)

    # --- a step ------------------------------------------------------------------------------

    def _validate(self, step: StepInput) -> tuple[np.ndarray, dict, list[RequestFailure]]:
        """Checks the whole step against the batch; returns the cached requests' rows, the new
        requests' grammar matchers (by seq_id), and the new requests whose grammar failed: those
        run unconstrained in this step, their tokens void, and the scheduler ends them."""
        sid = step.step_id
        if step.num_requests > self.config.max_num_seqs:
            raise InvalidStepError(f"step {sid}: {step.num_requests} requests exceed max_num_seqs "
                                   f"{self.config.max_num_seqs}")
        finished = set(step.finished_seq_ids)
        cached_ids = step.cached_seq_ids
        try:
            rows = self.batch.rows_of(cached_ids)
        except KeyError as exc:
            raise StaleMirrorError(f"step {sid}, cached request {exc.args[0]}: not running on this worker "
                                   f"(send it as a NewRequest)") from None
        if finished and not finished.isdisjoint(cached_ids):
            seq_id = next(s for s in cached_ids if s in finished)
            raise StaleMirrorError(f"step {sid}, cached request {seq_id}: listed as finished in the same step")
        seen = set(cached_ids)
        if len(seen) != len(cached_ids):
            raise InvalidStepError(f"step {sid}: a cached request is listed twice in one step")
        num_tokens = int(step.num_scheduled.sum())
        for new in step.new_requests:
            num_tokens += self._check_new(sid, new, seen, finished)
        if num_tokens > self.config.max_num_batched_tokens:
            raise InvalidStepError(f"step {sid}: {num_tokens} tokens exceed max_num_batched_tokens "
                                   f"{self.config.max_num_batched_tokens}")
        if len(rows):
            self._check_cached(step, rows)
        matchers, failed = {}, []
        if self.structured is not None:
            for new in step.new_requests:
                if new.constraint is not None:
                    matcher_or_failure = self.structured.matcher_or_failure(new.seq_id, new.constraint,
                                                                            new.output_token_ids)
                    if isinstance(matcher_or_failure, RequestFailure):
                        failed.append(matcher_or_failure)
                    else:
                        matchers[new.seq_id] = matcher_or_failure
        return rows, matchers, failed

    def _check_new(self, sid: int, new: NewRequest, seen: set[int], finished: set[int]) -> int:
        where = f"step {sid}, new request {new.seq_id}"
        if new.seq_id in seen:
            raise InvalidStepError(f"{where}: listed twice in one step")
        seen.add(new.seq_id)
        if new.seq_id in self.batch and new.seq_id not in finished:
            raise StaleMirrorError(f"{where}: already running here; list it in finished_seq_ids to re-send it")
        known = len(new.token_ids)
        if not 0 < new.num_prompt_tokens <= known:
            raise InvalidStepError(f"{where}: num_prompt_tokens {new.num_prompt_tokens} not in 1..{known} (token_ids)")
        if known > self.max_model_len:
            raise InvalidStepError(f"{where}: {known} tokens exceed max_model_len {self.max_model_len}")
        if max(new.token_ids) >= self.vocab_size:
            raise InvalidStepError(f"{where}: token id {max(new.token_ids)} >= vocab_size {self.vocab_size}")
        if new.sampling.logit_bias and new.sampling.logit_bias[-1][0] >= self.vocab_size:
            raise InvalidStepError(f"{where}: logit_bias token id {new.sampling.logit_bias[-1][0]} >= vocab_size "
                                   f"{self.vocab_size}")
        if new.num_scheduled_tokens == 0:
            raise InvalidStepError(f"{where}: num_scheduled_tokens is 0")
        end = new.num_computed_tokens + new.num_scheduled_tokens
        if end > known:
            raise InvalidStepError(f"{where}: scheduling past the known tokens ({new.num_computed_tokens} computed + "
                                   f"{new.num_scheduled_tokens} scheduled > {known} known)")
        blocks = new.block_ids
        if blocks and max(blocks) >= self.num_kv_blocks:
            raise InvalidStepError(f"{where}: block id {max(blocks)} out of range (the cache has {self.num_kv_blocks})")
        if len(blocks) > self.max_blocks_per_seq:
            raise InvalidStepError(f"{where}: {len(blocks)} blocks exceed {self.max_blocks_per_seq} (max_model_len "
                                   f"{self.max_model_len} / block_size {self.block_size})")
        if len(blocks) * self.block_size < end:
            raise InvalidStepError(f"{where}: {len(blocks)} blocks of {self.block_size} cannot hold {end} tokens")
        return new.num_scheduled_tokens

    def _check_cached(self, step: StepInput, rows: np.ndarray) -> None:
        """The cached columns against the rows, vectorised; the message names the first offender."""
        sid, b = step.step_id, self.batch

        def refuse(bad: np.ndarray, why) -> None:
            i = int(np.flatnonzero(bad)[0])
            raise InvalidStepError(f"step {sid}, cached request {step.cached_seq_ids[i]}: {why(i)}")

        counts = step.num_scheduled
        start = b.num_computed[rows]
        end = start + counts
        num_tokens = b.num_tokens[rows]
        if np.any(end > num_tokens):
            refuse(end > num_tokens, lambda i: f"scheduling past the known tokens ({start[i]} computed + "
                                               f"{counts[i]} scheduled > {num_tokens[i]} known)")
        # Sampled tokens are known on the device only as each row's newest: a step may compute
        # the newest, never an older one the host does not have.
        num_host = b.num_host_tokens[rows]
        unknown = np.maximum(start, num_host) < np.minimum(end, num_tokens - 1)
        if np.any(unknown):
            refuse(unknown, lambda i: f"positions {max(start[i], num_host[i])}..{end[i] - 1} include sampled tokens "
                                      f"older than the newest (re-send it as a NewRequest)")
        num_blocks = b.num_blocks[rows].copy()
        if len(step.new_block_indices):
            ids = step.new_block_ids
            if ids.max() >= self.num_kv_blocks:
                raise InvalidStepError(f"step {sid}: block id {int(ids.max())} out of range (the cache has "
                                       f"{self.num_kv_blocks})")
            num_blocks[step.new_block_indices] += step.new_block_counts
        too_many = num_blocks > self.max_blocks_per_seq
        if np.any(too_many):
            refuse(too_many, lambda i: f"{num_blocks[i]} blocks exceed {self.max_blocks_per_seq} (max_model_len "
                                       f"{self.max_model_len} / block_size {self.block_size})")
        short = num_blocks * self.block_size < end
        if np.any(short):
            refuse(short, lambda i: f"{num_blocks[i]} blocks of {self.block_size} cannot hold {end[i]} tokens")

    def _apply(self, step: StepInput, cached_rows: np.ndarray, matchers: dict) -> tuple[np.ndarray, np.ndarray]:
        """Drops finished requests, admits new ones, appends blocks. Returns the step's rows and
        token counts in batch order: the cached requests, then the new ones."""
        for seq_id in step.finished_seq_ids:
            if seq_id in self.batch:     # unknown ids were never sent here or already dropped
                self._drop(seq_id)
        new_rows = []
        for new in step.new_requests:
            penalty_row = (self.sampler.add_request(new.token_ids, new.num_prompt_tokens, new.sampling)
                           if self.sampler is not None else None)
            new_rows.append(self.batch.add(new, penalty_row, matchers.get(new.seq_id)))
        if len(step.new_block_indices):
            self.batch.append_blocks(cached_rows, step.new_block_indices, step.new_block_counts, step.new_block_ids)
        if self.batch.capacity > len(self.last_sampled):   # the batch grew past max_num_seqs rows
            grown = self.last_sampled.new_zeros(self.batch.capacity)
            grown[:len(self.last_sampled)] = self.last_sampled
            self.last_sampled = grown
        if not new_rows:
            return cached_rows, step.num_scheduled
        new_counts = [new.num_scheduled_tokens for new in step.new_requests]
        return (np.concatenate([cached_rows, np.array(new_rows, dtype=np.int64)]),
                np.concatenate([step.num_scheduled, np.array(new_counts, dtype=np.int64)]))

    def _drop(self, seq_id: int) -> None:
        penalty_row = self.batch.remove(seq_id)
        if self.sampler is not None:
            self.sampler.remove_request(penalty_row)

    def _prepare(self, rows: np.ndarray, counts: np.ndarray) -> StepBatch:
        """The step's flat inputs, vectorised over rows and scheduled tokens (never over a
        request's whole context), in one host-to-device copy. Advances the rows' counts: the
        computed tokens, and the token each sampling row is about to get."""
        b, bs = self.batch, self.block_size
        start = b.num_computed[rows]
        seq_lens = start + counts
        query_start = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(counts, out=query_start[1:])
        num_tokens = int(query_start[-1])
        positions = np.arange(num_tokens) + np.repeat(start - query_start[:-1], counts)
        token_rows = np.repeat(rows, counts)
        # A position the host knows reads its token here; the one past them (a decode of the
        # newest sampled token) is gathered on the device from the row's last sample.
        on_host = positions < b.num_host_tokens[token_rows]
        input_ids = np.where(on_host, b.token_ids[token_rows, np.minimum(positions, self.max_model_len - 1)], 0)
        gather_at = np.flatnonzero(~on_host)
        gather_rows = token_rows[gather_at]
        slot_mapping = b.block_tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // bs)
        block_tables = b.block_tables[rows, :width]
        samples = seq_lens == b.num_tokens[rows]     # a chunk ending mid-prompt samples nothing
        logits_indices = query_start[1:][samples] - 1
        sampling_rows = rows[samples]
        seeded = []
        constrained = top_ks = None
        constrained_at = top_at = _NONE
        if self.sampler is not None:
            meta = self._sampling_metadata(sampling_rows)
            if meta.seeded:
                drawing_rows = sampling_rows[meta.drawing]
                seeded = [int(b.num_tokens[drawing_rows[j]] - b.num_prompt[drawing_rows[j]]) for j, _ in meta.seeded]
            if b.num_constrained:
                constrained_at = np.flatnonzero(b.constrained[sampling_rows])
                if len(constrained_at):
                    constrained = [b.matchers[r] for r in sampling_rows[constrained_at].tolist()]
            if b.num_top_logprobs:
                top_ks = b.top_logprobs[sampling_rows]
                top_at = np.flatnonzero(top_ks)
                if not len(top_at):
                    top_ks = None
        score_at, score_targets, scored = (self._prompt_scoring(rows, start, seq_lens, query_start) if b.num_scoring
                                           else (_NONE, _NONE, None))
        parts = [input_ids, positions, slot_mapping, query_start, seq_lens, logits_indices, sampling_rows, gather_at,
                 gather_rows, block_tables.reshape(-1)]
        # What only some requests ask for travels only when asked (a plain step copies nothing more).
        extras = (constrained_at, top_at, score_at, score_targets)
        asked = any(len(part) for part in extras)
        views = self._staging.fill(parts + list(extras) if asked else parts)
        (ids_d, positions_d, slots_d, query_start_d, seq_lens_d, logits_d, sampling_d, gather_at_d, gather_rows_d,
         tables_d) = views[:10]
        constrained_d, top_d, score_at_d, score_targets_d = views[10:] if asked else (None,) * 4
        if len(gather_at):
            ids_d.index_copy_(0, gather_at_d, self.last_sampled.index_select(0, gather_rows_d))
        b.num_computed[rows] = seq_lens
        b.num_tokens[sampling_rows] += 1
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            query_start_loc=query_start_d.to(torch.int32),
            seq_lens=seq_lens_d.to(torch.int32),
            block_tables=tables_d.view(len(rows), width).to(torch.int32),
            max_query_len=int(counts.max()),
            max_seq_len=max_seq_len,
            query_lens_cpu=counts.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return StepBatch(ids_d, positions_d, meta, logits_d, sampling_rows, sampling_d, seeded,
                         constrained=(constrained_at.tolist(), constrained, constrained_d) if constrained else None,
                         top_ks=top_ks, top_positions=top_d if top_ks is not None else None,
                         score_indices=score_at_d if scored else None,
                         score_targets=score_targets_d if scored else None, scored=scored or None)

    def _prompt_scoring(self, rows: np.ndarray, start: np.ndarray, seq_lens: np.ndarray, query_start: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int, int]]]:
        """The step's prompt tokens to score: the logits at position p score the token at p + 1,
        so a chunk computing positions start..end-1 scores the prompt tokens start+1..end, up to
        the last prompt token (whose logits sample the first output token instead). Returns the
        flat indices of the positions, the tokens they score, and per request (seq_id, first
        position scored, count, top_logprobs). A row whose prompt is scored to its end stops
        being a scoring row."""
        b = self.batch
        indices, targets, scored = [], [], []
        for i in np.flatnonzero(b.scores_prompt[rows]).tolist():
            row = int(rows[i])
            first, last = int(start[i]), int(b.num_prompt[row]) - 1
            end = min(int(seq_lens[i]), last)
            if end > first:
                indices.append(query_start[i] + np.arange(end - first))
                targets.append(b.token_ids[row, first + 1:end + 1])
                scored.append((int(b.seq_id_of[row]), first + 1, end - first, int(b.top_logprobs[row])))
            if end == last:
                b.prompt_scored(row)
        if not scored:
            return _NONE, _NONE, []
        return np.concatenate(indices), np.concatenate(targets), scored

    def _sampling_metadata(self, sampling_rows: np.ndarray) -> SamplingMetadata:
        """The sampler's per-row facts, rebuilt only when the sampling rows or the batch change."""
        key = (self.batch.version, sampling_rows.tobytes())
        if self._sampling_cache is None or self._sampling_cache[0] != key:
            options = [self.batch.options[r] for r in sampling_rows.tolist()]
            penalty_rows = [self.batch.penalty_rows[r] for r in sampling_rows.tolist()]
            self._sampling_cache = (key, self.sampler.metadata(options, penalty_rows))
        return self._sampling_cache[1]

    @torch.inference_mode()
    def _execute(self, step_id: int, batch: StepBatch, started: float, prepare_ms: float) -> PendingStep:
        """Enqueues the forward and the sampling; the tokens land in a pinned slot behind an event."""
        launched = time.perf_counter()
        device_start = None
        if self.device.type == "cuda":
            device_start = torch.cuda.Event(enable_timing=True)
            device_start.record()
        # Constrained rows' masks are filled in the background while the forward runs.
        fill = self.structured.start_fill(batch.constrained[1]) if batch.constrained is not None else None
        hidden = self.run_model(batch.input_ids, batch.positions, batch.meta)
        extra = self._score_prompt(hidden, batch) if batch.scored is not None else None
        num_sampled = len(batch.sampling_rows)
        host_tokens = host_logprobs = release = None
        failed: list[RequestFailure] = []
        if num_sampled:
            logits = self.model.compute_logits(hidden, batch.logits_indices)
            logprobs = None
            if self.sampler is not None:
                if batch.constrained is not None:   # waits for the masks started before the forward
                    failed = self.structured.mask(logits, batch.constrained[0], fill)
                meta = self._sampling_metadata(batch.sampling_rows)
                tokens, logprobs = self.sampler.sample(logits, meta, batch.seeded_output_indices)
                if batch.constrained is not None:
                    self.structured.record(batch.constrained[1], tokens, batch.constrained[2])
                if batch.top_ks is not None:
                    extra = extra or _Logprobs()
                    ids, values = top_logprobs(logits.index_select(0, batch.top_positions), int(batch.top_ks.max()))
                    extra.top_ks, extra.top_ids, extra.top_values = batch.top_ks, _to_host(ids), _to_host(values)
            else:                    # not rank 0: rank 0's tokens keep this rank's rows identical
                tokens = None
            tokens = broadcast_tokens(tokens, num_sampled, self.device)
            self.last_sampled.index_copy_(0, batch.sampling_rows_device, tokens)
            slot = self._outputs.acquire()
            release = lambda: self._outputs.release(slot)  # noqa: E731
            host_tokens = self._outputs.tokens[slot]
            host_tokens[:num_sampled].copy_(tokens, non_blocking=True)
            if logprobs is not None:
                host_logprobs = self._outputs.logprobs[slot]
                host_logprobs[:num_sampled].copy_(logprobs, non_blocking=True)
        elif extra is None:
            return PendingStep(step_id, started, prepare_ms, (time.perf_counter() - launched) * 1e3, 0,
                               None, None, None, None)
        event = None
        if device_start is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        forward_ms = (time.perf_counter() - launched) * 1e3
        pending = PendingStep(step_id, started, prepare_ms, forward_ms, num_sampled, host_tokens, host_logprobs,
                              event, release, device_start, extra)
        pending.failed += failed
        return pending

    def _score_prompt(self, hidden: torch.Tensor, batch: StepBatch) -> _Logprobs | None:
        """Scores the step's prompt tokens (on every rank: the LM head is a collective; rank 0
        gets the values). Slices of max_num_seqs positions: the sampling of as many rows is what
        the start-up memory profile measured."""
        k = max(k for _, _, _, k in batch.scored)
        scored = score_tokens(self.model.compute_logits, hidden, batch.score_indices, batch.score_targets, k,
                              self.config.max_num_seqs)
        if scored is None:       # not rank 0
            return None
        scores, top_ids, top_values = scored
        return _Logprobs(scored=batch.scored, scores=_to_host(scores), score_top_ids=_to_host(top_ids),
                         score_top_values=_to_host(top_values))

    def _select_attention_backend(self):
        """The configured backend, or the fastest on this device for this model's attention
        (every rank of a group agrees on one), warmed up before the memory profile and capture."""
        configure_kernel_cache(self.config.kernel_cache_dir)
        shape = AttentionShape(
            num_heads=self.model_config.num_attention_heads // self.tp_size, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=self.dtype, block_size=self.block_size,
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len)

        def agree(totals: list[float]) -> list[float]:
            parallel_state.barrier("attention measured")   # first compiles take uneven time
            return all_reduce_max(totals, self.device)

        return select_attention_backend(self.config.attention_backend, self.device, shape,
                                        reduce_across_ranks=agree if self.tp_size > 1 else None)

    def _capture_decode_graphs(self):
        """CUDA graphs of the decode forward, where the device and the backend allow them."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if not getattr(self.backend, "supports_cuda_graphs", False):
            logger.info("attention backend %s cannot be captured: decoding eagerly", self.backend.name)
            return None
        from worker_svc.cuda_graphs import DecodeGraphs   # CUDA only

        start = time.perf_counter()
        graphs = DecodeGraphs(self.model, max_batch_size=self.config.max_num_seqs,
                              max_blocks_per_seq=self.max_blocks_per_seq, max_model_len=self.max_model_len,
                              device=self.device)
        logger.info("captured %d decode graphs in %.1f s", len(graphs.graphs), time.perf_counter() - start)
        return graphs

    # --- KV-cache sizing -----------------------------------------------------------------------

    def _size_kv_cache(self) -> int:
        config = self.config
        per_block = kv_cache.block_bytes(self.model_config.num_hidden_layers, self.block_size, self.num_kv_heads,
                                         self.head_dim, self.dtype)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory_gb is not None:
            num_blocks = kv_cache.blocks_for_memory(config.kv_cache_memory_gb, per_block)
        elif self.device.type == "cuda":
            self._warm_up()
            num_blocks = kv_cache.cuda_free_blocks(self.device, per_block, config.gpu_memory_utilization)
        else:
            num_blocks = kv_cache.cpu_default_blocks(per_block)
        # The scheduler hands out one set of block ids for the whole group: every rank holds
        # as many blocks as the tightest one can.
        num_blocks = all_reduce_min(num_blocks, self.device)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (a block takes {per_block} bytes)")
        return num_blocks

    def _warm_up(self) -> None:
        """One forward at max_num_batched_tokens and one sampling of max_num_seqs rows (with the
        sort that top-k/top-p need), so the memory profile sees the activation peak."""
        config = self.config
        seq_len = min(config.max_num_batched_tokens, self.max_model_len)
        num_seqs = max(min(config.max_num_batched_tokens // seq_len, config.max_num_seqs), 1)
        blocks_per_seq = -(-seq_len // self.block_size)
        kv_cache.allocate_kv_cache(self.model, num_seqs * blocks_per_seq, self.block_size,
                                   self.num_kv_heads, self.head_dim, self.dtype, self.device)
        warm_options = SamplingOptions(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)
        new_requests = [NewRequest(-1 - i, [0] * seq_len, seq_len, 0, seq_len,
                                   list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), warm_options)
                        for i in range(num_seqs)]
        warm = StepInput(0, [], new_requests, [], np.zeros(0, np.int64), np.zeros(0, np.int64),
                         np.zeros(0, np.int64), np.zeros(0, np.int64))
        torch.cuda.reset_peak_memory_stats(self.device)
        rows, counts = self._apply(warm, np.zeros(0, np.int64), {})
        self._execute(0, self._prepare(rows, counts), time.perf_counter(), 0.0).result()
        if self.sampler is not None:
            row = _WarmRow(warm_options)
            self.sampler.sample_rows(torch.zeros(config.max_num_seqs, self.vocab_size, device=self.device),
                                     [row] * config.max_num_seqs)
        self.reset()
        kv_cache.unbind_kv_cache(self.model)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass
class _WarmRow:
    sampling: SamplingOptions
    penalty_row: int | None = None
    num_output_tokens: int = 0
