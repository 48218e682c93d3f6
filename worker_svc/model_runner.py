"""Runs engine steps: keeps the request mirrors, builds each step's batch, runs the model and
samples. The scheduler decides everything; this validates what it is told and executes it."""
from __future__ import annotations

import contextlib
import logging
import pathlib
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from common.model_dir import read_model_facts
from common.pb.llm.worker.v1 import worker_pb2
from worker_svc import kv_cache, parallel_state
from worker_svc.config import WorkerConfig
from worker_svc.layers.attention import AttentionMetadata, get_attention_backend
from worker_svc.layers.sampler import Sampler, SamplingOptions
from worker_svc.loader import init_dummy_weights, load_safetensors
from worker_svc.model_config import load_model_config
from worker_svc.models import build_model
from worker_svc.models.qwen3 import head_dim_of
from worker_svc.parallel_state import all_reduce_min, broadcast_token_ids, get_tp_rank, get_tp_size
from worker_svc.request_state import RequestMirror, RequestState

logger = logging.getLogger(__name__)


class InvalidStepError(ValueError):
    """The step contradicts itself or the worker's limits; nothing was changed."""


class StaleMirrorError(InvalidStepError):
    """The step names requests this worker does not hold (or already holds): its mirror and the
    scheduler's view differ, e.g. after a worker restart. The scheduler should re-send them."""


_DEFAULT_BLOCK_SIZE = 16
_FLASH_ATTN_BLOCK_SIZE = 256    # flash_attn_with_kvcache wants paged blocks of 256 tokens


@dataclass
class InputBatch:
    input_ids: torch.Tensor         # int64 [num_tokens]
    positions: torch.Tensor         # int64 [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor    # int64 [num_sampling]: the last token of each sampling request
    sampling: list[RequestState]    # requests whose computed tokens reach their known tokens


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
        self.model_name = read_model_facts(model_dir).name
        self.model_config = model_config = load_model_config(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.block_size = config.block_size or (
            _FLASH_ATTN_BLOCK_SIZE if self.backend.name == "flash_attn" else _DEFAULT_BLOCK_SIZE
        )
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.vocab_size = model_config.vocab_size
        self.num_kv_heads = model_config.num_key_value_heads // self.tp_size
        self.head_dim = head_dim_of(model_config)

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
        self.mirror = RequestMirror(self.max_blocks_per_seq)
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
        )

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        """Raises InvalidStepError (a ValueError), before changing any state, when the step
        contradicts itself, the worker's limits or its mirror. Every rank of a tensor-parallel
        group runs the same steps in the same order; only rank 0 reports sampled tokens."""
        start = time.perf_counter()
        if parallel_state.group_broken().is_set():
            raise RuntimeError("the tensor-parallel group is broken; this worker is exiting")
        scheduled = self._apply(req)
        response = worker_pb2.StepResponse(step_id=req.step_id)
        if scheduled:
            batch = self._prepare(scheduled)
            prepared = time.perf_counter()
            try:
                token_ids, logprobs = self._execute(batch)
            except Exception as exc:
                if self.tp_size > 1:   # the other ranks are left waiting in a collective
                    parallel_state.mark_broken(f"step {req.step_id} failed: {exc!r}")
                raise
            for state, num_tokens in scheduled:
                state.num_computed_tokens += num_tokens
            for state, token_id in zip(batch.sampling, token_ids):
                state.token_ids.append(token_id)
            if self.tp_rank == 0:
                for state, token_id, logprob in zip(batch.sampling, token_ids, logprobs):
                    response.sampled.add(seq_id=state.seq_id, token_id=token_id, logprob=logprob)
            done = time.perf_counter()
            response.timings.prepare_ms = (prepared - start) * 1e3
            response.timings.forward_ms = (done - prepared) * 1e3
        response.timings.total_ms = (time.perf_counter() - start) * 1e3
        return response

    def reset(self) -> None:
        for seq_id in self.mirror.seq_ids():
            self._drop(seq_id)

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every token of the batch; pure-decode batches replay a CUDA graph."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            return self.decode_graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta)

    # --- a step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def _execute(self, batch: InputBatch) -> tuple[list[int], list[float]]:
        """Token ids of the sampling requests (on every rank) and their logprobs (rank 0)."""
        hidden = self.run_model(batch.input_ids, batch.positions, batch.meta)
        if not batch.sampling:
            return [], []
        logits = self.model.compute_logits(hidden, batch.logits_indices)
        if self.sampler is None:   # not rank 0: its tokens keep this rank's mirror identical
            return broadcast_token_ids(None, len(batch.sampling), self.device), []
        token_ids, logprobs = self.sampler.sample(logits, batch.sampling)
        return broadcast_token_ids(token_ids, len(token_ids), self.device), logprobs

    def _apply(self, req: worker_pb2.StepRequest) -> list[tuple[RequestState, int]]:
        """Validates the step, then updates the mirror: drops, admissions, appended blocks.
        Returns (request, tokens to compute) in batch order: new requests, then cached ones."""
        options = self._validate(req)
        for seq_id in req.finished_seq_ids:
            if seq_id in self.mirror:     # unknown ids were never sent here or already dropped
                self._drop(seq_id)
        scheduled = []
        for new in req.new_requests:
            token_ids = list(new.token_ids)
            sampling = options[new.seq_id]
            penalty_row = (self.sampler.add_request(token_ids, new.num_prompt_tokens, sampling)
                           if self.sampler is not None else None)
            state = self.mirror.add(new.seq_id, token_ids, new.num_prompt_tokens, new.num_computed_tokens,
                                    list(new.block_ids), sampling, penalty_row)
            scheduled.append((state, new.num_scheduled_tokens))
        for cached in req.cached_requests:
            state = self.mirror[cached.seq_id]
            self.mirror.append_blocks(state, list(cached.new_block_ids))
            scheduled.append((state, cached.num_scheduled_tokens))
        return scheduled

    def _drop(self, seq_id: int) -> None:
        state = self.mirror.remove(seq_id)
        if self.sampler is not None:
            self.sampler.remove_request(state.penalty_row)

    def _validate(self, req: worker_pb2.StepRequest) -> dict[int, SamplingOptions]:
        """Checks the whole step against the mirror; returns the new requests' parsed options."""
        finished = set(req.finished_seq_ids)
        batch_size = len(req.new_requests) + len(req.cached_requests)
        if batch_size > self.config.max_num_seqs:
            raise InvalidStepError(f"step {req.step_id}: {batch_size} requests exceed max_num_seqs {self.config.max_num_seqs}")
        seen: set[int] = set()
        options: dict[int, SamplingOptions] = {}
        num_tokens = 0
        for new in req.new_requests:
            where = f"step {req.step_id}, new request {new.seq_id}"
            self._check_unique(new.seq_id, seen, where)
            if new.seq_id in self.mirror and new.seq_id not in finished:
                raise StaleMirrorError(f"{where}: already running here; list it in finished_seq_ids to re-send it")
            known = len(new.token_ids)
            if not 0 < new.num_prompt_tokens <= known:
                raise InvalidStepError(f"{where}: num_prompt_tokens {new.num_prompt_tokens} not in 1..{known} (token_ids)")
            if known > self.max_model_len:
                raise InvalidStepError(f"{where}: {known} tokens exceed max_model_len {self.max_model_len}")
            if max(new.token_ids) >= self.vocab_size:
                raise InvalidStepError(f"{where}: token id {max(new.token_ids)} >= vocab_size {self.vocab_size}")
            self._check_schedule(where, new.num_computed_tokens, new.num_scheduled_tokens, known)
            self._check_blocks(where, new.block_ids, 0, new.num_computed_tokens + new.num_scheduled_tokens)
            try:
                options[new.seq_id] = SamplingOptions.from_proto(new.sampling)
            except ValueError as exc:
                raise InvalidStepError(f"{where}: {exc}") from None
            num_tokens += new.num_scheduled_tokens
        for cached in req.cached_requests:
            where = f"step {req.step_id}, cached request {cached.seq_id}"
            self._check_unique(cached.seq_id, seen, where)
            if cached.seq_id not in self.mirror or cached.seq_id in finished:
                raise StaleMirrorError(f"{where}: not running on this worker (send it as a NewRequest)")
            state = self.mirror[cached.seq_id]
            self._check_schedule(where, state.num_computed_tokens, cached.num_scheduled_tokens, len(state.token_ids))
            self._check_blocks(where, cached.new_block_ids, state.num_blocks,
                               state.num_computed_tokens + cached.num_scheduled_tokens)
            num_tokens += cached.num_scheduled_tokens
        if num_tokens > self.config.max_num_batched_tokens:
            raise InvalidStepError(f"step {req.step_id}: {num_tokens} tokens exceed max_num_batched_tokens "
                             f"{self.config.max_num_batched_tokens}")
        return options

    @staticmethod
    def _check_unique(seq_id: int, seen: set[int], where: str) -> None:
        if seq_id in seen:
            raise InvalidStepError(f"{where}: listed twice in one step")
        seen.add(seq_id)

    @staticmethod
    def _check_schedule(where: str, num_computed: int, num_scheduled: int, num_known: int) -> None:
        if num_scheduled == 0:
            raise InvalidStepError(f"{where}: num_scheduled_tokens is 0")
        if num_computed + num_scheduled > num_known:
            raise InvalidStepError(f"{where}: scheduling past the known tokens ({num_computed} computed + "
                             f"{num_scheduled} scheduled > {num_known} known)")

    def _check_blocks(self, where: str, block_ids, num_blocks_before: int, num_tokens: int) -> None:
        if block_ids and max(block_ids) >= self.num_kv_blocks:
            raise InvalidStepError(f"{where}: block id {max(block_ids)} out of range (the cache has {self.num_kv_blocks})")
        num_blocks = num_blocks_before + len(block_ids)
        if num_blocks > self.max_blocks_per_seq:
            raise InvalidStepError(f"{where}: {num_blocks} blocks exceed {self.max_blocks_per_seq} (max_model_len "
                             f"{self.max_model_len} / block_size {self.block_size})")
        if num_blocks * self.block_size < num_tokens:
            raise InvalidStepError(f"{where}: {num_blocks} blocks of {self.block_size} cannot hold {num_tokens} tokens")

    def _prepare(self, scheduled: list[tuple[RequestState, int]]) -> InputBatch:
        """The step's flat batch. Python loops touch each request once and each scheduled token
        once; the rest is vectorised over those, never over a request's whole context."""
        num_computed = np.fromiter((s.num_computed_tokens for s, _ in scheduled), np.int64, len(scheduled))
        query_lens = np.fromiter((n for _, n in scheduled), np.int64, len(scheduled))
        rows = np.fromiter((s.row for s, _ in scheduled), np.int64, len(scheduled))
        seq_lens = num_computed + query_lens
        query_start = np.zeros(len(scheduled) + 1, np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        positions = np.arange(query_start[-1]) + np.repeat(num_computed - query_start[:-1], query_lens)
        token_blocks = self.mirror.block_tables[np.repeat(rows, query_lens), positions // self.block_size]
        slot_mapping = token_blocks.astype(np.int64) * self.block_size + positions % self.block_size
        max_seq_len = int(seq_lens.max())
        block_tables = self.mirror.block_tables[rows, :-(-max_seq_len // self.block_size)]
        input_ids: list[int] = []
        sampling_indices, sampling = [], []
        for i, (state, num_tokens) in enumerate(scheduled):
            input_ids += state.token_ids[state.num_computed_tokens:state.num_computed_tokens + num_tokens]
            if seq_lens[i] == len(state.token_ids):    # a chunk ending mid-prompt samples nothing
                sampling_indices.append(query_start[i + 1] - 1)
                sampling.append(state)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping, torch.int64),
            query_start_loc=self._to_device(query_start, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=self._to_device(block_tables, torch.int32),
            max_query_len=int(query_lens.max()),
            max_seq_len=max_seq_len,
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return InputBatch(
            input_ids=self._to_device(np.array(input_ids, np.int64), torch.int64),
            positions=self._to_device(positions, torch.int64),
            meta=meta,
            logits_indices=self._to_device(np.array(sampling_indices, np.int64), torch.int64),
            sampling=sampling,
        )

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

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
        scheduled = []
        for i in range(num_seqs):
            blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            state = self.mirror.add(-1 - i, [0] * seq_len, seq_len, 0, blocks, warm_options, None)
            scheduled.append((state, seq_len))
        torch.cuda.reset_peak_memory_stats(self.device)
        self._execute(self._prepare(scheduled))
        if self.sampler is not None:
            sampling_rows = [scheduled[0][0]] * config.max_num_seqs
            self.sampler.sample(torch.zeros(config.max_num_seqs, self.vocab_size, device=self.device), sampling_rows)
        self.reset()
        kv_cache.unbind_kv_cache(self.model)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
