"""Prepares and executes engine steps: keeps the persistent batch, builds each step's inputs,
runs the model and samples. The scheduler decides everything; the runner checks what it is told
(step_checks.py) and executes it. Its start-up (backend, weights, KV cache, graphs) is startup.py.

A step is launched, then awaited (`launch(step).result()`): launching checks and applies the
step, prepares its inputs with vectorised host work and one host-to-device copy (batch_prep.py),
and enqueues the forward and the sampling on the device; the sampled tokens are copied back
behind an event. `result()` waits for that event. So a caller that launches step N+1 right after
N (the gRPC server does, from another thread) prepares N+1 while the device still runs N, and
N+1's decode inputs are N's sampled tokens, gathered on the device from the rows' newest token.

What only some requests ask for costs only the steps that hold such requests: a grammar's token
mask (structured_output.py: the one place a step waits for the step before it), the top
logprobs of sampled tokens (layers/logprobs.py) and the scores of prompt tokens (prompt_scoring.py).

Speculative decoding (spec_decode/): a decode may compute draft tokens after its newest token and
sample at each of them (spec_decode/verification.py says how that stays exact); the persistent
batch learns what was accepted once the step's tokens are back (spec_decode/bookkeeping.py), so a
step that verifies drafts waits for the steps before it, unless the device can derive its inputs
from the acceptance of the one in flight (spec_decode/ahead.py). A proposer on the device (eagle3, draft:
spec_decode/drafter.py) runs after the sampling, on the same batch, in every step that asks for drafts;
the others (past the scheduler's batch threshold) replay the decode graphs as without speculation.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import pathlib
import threading
import time
import uuid

import numpy as np
import torch

from common.constraint import Constraint
from common.features import check_features
from common.model_dir import read_model_facts
from worker_svc import kv_cache, parallel_state, startup
from worker_svc.batch_prep import prepare_batch
from worker_svc.config import WorkerConfig
from worker_svc.input_batch import InputBatch
from worker_svc.graph_inputs import DecodeLayout
from worker_svc.layers import device_sampler
from worker_svc.layers.attention import AttentionMetadata
from worker_svc.layers.attention.kv_quant import dtype_name, resolve_kv_cache_dtype
from worker_svc.layers.logprobs import top_logprobs
from worker_svc.layers.sampler import Sampler, SamplingMetadata
from worker_svc.model_config import load_model_config
from worker_svc.models.qwen3 import head_dim_of
from worker_svc.parallel_state import broadcast_tokens
from worker_svc.prompt_scoring import score_prompt
from worker_svc.runner_io import InvalidStepError, RequestFailure, StaleMirrorError, StepInput, StepOutput, WorkerInfo
from worker_svc.spec_decode.ahead import Ahead, plan_ahead, prepare_ahead
from worker_svc.spec_decode.bookkeeping import Bookkeeping, SpecStep
from worker_svc.spec_decode.proposers import build_proposer
from worker_svc.spec_decode.verification import accept, decode_rows, preceding_drafts
from worker_svc.staging import Logprobs, OutputSlots, PendingStep, Staging, step_done_event, to_host
from worker_svc.step_batch import StepBatch
from worker_svc.step_checks import StepLimits, check_requests, check_rows
from worker_svc.step_limits import HELD_PER_SEQ_SLOT, with_step_limits
from worker_svc.step_profile import EagerStepProfiler
from worker_svc.structured_output import MaskFill, StructuredOutput

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "InvalidStepError", "StaleMirrorError", "PendingStep", "StepBatch"]


class ModelRunner:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = startup.resolve_device(config.device)
        self.config = config = with_step_limits(config, self.device)
        self.tp_rank, self.tp_size = startup.tensor_parallel_rank(config)
        model_dir = pathlib.Path(config.model)
        facts = read_model_facts(model_dir)
        self.model_name = facts.name
        self.model_config = model_config = load_model_config(model_dir)
        self.dtype = startup.resolve_dtype(config.dtype, self.device, model_config)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size or startup.DEFAULT_BLOCK_SIZE
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.vocab_size = model_config.vocab_size
        self.num_kv_heads = model_config.num_key_value_heads // self.tp_size
        self.head_dim = head_dim_of(model_config)
        self.backend = startup.select_backend(self)
        self.model = startup.load_model(self, model_dir)
        # Rank 0 alone samples (and keeps penalty state); the others take its tokens. On a GPU with
        # one rank and --sampler kernels/auto the device sampler does (inside the decode graphs, and
        # a speculating worker's verified positions: DeviceSampler.sample_ahead), else the torch
        # sampler.
        self.num_speculative_tokens = k = config.num_speculative_tokens if config.speculative_method else 0
        self.verify_as_decodes = True     # a decode-only verifying step replays the decode graphs
        self.sampler = self.device_sampler = None
        # Requests held at once: each running one and as many paused beside them (a paused request
        # keeps its mirror). Per-row tensors the decode graphs read are sized for them; the
        # scheduler keeps within it (WorkerInfo.max_held_requests).
        self.max_held_requests = HELD_PER_SEQ_SLOT * config.max_num_seqs
        # Every rank knows whether rank 0 samples on the device (ranks decide a step's path alike).
        self.samples_on_device = device_sampler.wanted(config.sampler, self.device, self.tp_size)
        if self.tp_rank == 0 and self.samples_on_device:
            self.device_sampler = device_sampler.DeviceSampler(
                self.vocab_size, self.device, config.seed, capacity=self.max_held_requests,
                max_rows=config.max_num_seqs)
        if self.tp_rank == 0 and self.device_sampler is None:
            self.sampler = Sampler(self.vocab_size, self.device, config.seed)
        self.features = check_features()
        self.structured = (StructuredOutput(model_dir, self.vocab_size, facts.eos_token_ids, self.device,
                                            feature=self.features[0], compile_timeout_s=config.grammar_compile_timeout,
                                            compile_processes=config.grammar_compile_processes,
                                            mask_budget_ms=config.max_mask_ms)
                           if self.tp_rank == 0 else None)
        if self.structured is not None:   # CUDA: beside the graph capture; CPU: now, before any step
            self.structured.load_in_background() if self.device.type == "cuda" else self.structured.load()
        self.batch = InputBatch(self.max_model_len, self.max_blocks_per_seq, initial_rows=config.max_num_seqs,
                                max_drafts=k)
        self._sampling_cache: tuple[tuple[int, bytes], SamplingMetadata] | None = None
        max_tokens, max_seqs = config.max_num_batched_tokens, config.max_num_seqs
        # The step's integer inputs: input ids, positions and slots per token; query starts,
        # lengths and block tables per request; logits indices, sampling rows and the decode
        # tokens to gather per sampling request; constrained and top-logprob positions among
        # them; prompt tokens to score and their targets; a verification's layout and the row of
        # each verified position; a device proposer's drafting plan (spec_decode/drafter.py).
        # A speculating worker's decode-shaped steps are staged in the decode graphs' layout
        # (graph_inputs.py), with one row per token of a verified run.
        self.graph_tokens = startup.decode_graph_tokens(max_seqs, k, config.speculative_graph_batch_size)
        self._decode_layout = DecodeLayout(self.graph_tokens)
        staged_decode = self._decode_layout.offsets(self.graph_tokens, self.max_blocks_per_seq)[-1]
        self._staging = Staging((11 if k else 5) * max_tokens + max_seqs * (self.max_blocks_per_seq + 10) + 1
                                + (max_seqs * (self.max_blocks_per_seq + 3) + staged_decode if k else 0),
                                self.device)
        max_positions = decode_rows(max_seqs, k)   # sampled positions of a step: every request verifying k drafts
        self._outputs = OutputSlots(max_positions, self.device)
        # Speculative decoding: the proposer, and the bookkeeping of steps whose tokens are not
        # back yet, which changes the batch from the thread that reads a step's result.
        # A proposer on the device (eagle3, draft: the drafter) runs after the sampling of each step
        # that asks for drafts.
        self.proposer = build_proposer(self, config) if k else None
        self.drafter = self.proposer if k and self.proposer.on_device else None
        self._batch_lock = threading.RLock()   # launch holds it while _execute takes it again
        self._eager_profile = EagerStepProfiler(device=self.device)   # a diagnostic, off by default
        self.bookkeeping = (Bookkeeping(self.batch, self.max_model_len, self._batch_lock,
                                        None if self.drafter else self.proposer.propose_on_host) if k else None)
        # Each row's newest sampled token, on the device: the next decode's input (with the device
        # sampler, one more entry for its dummy row, which the padding of a graph's batch samples).
        rows = self.device_sampler.capacity + 1 if self.device_sampler is not None else self.max_held_requests
        self.last_sampled = torch.zeros(rows, dtype=torch.int64, device=self.device)
        if self.device_sampler is not None:   # where it samples outside the graphs (every verified position)
            self._tokens = torch.zeros(max_positions, dtype=torch.int64, device=self.device)
            self._logprobs = torch.zeros(max_positions, dtype=torch.float32, device=self.device)
        self._row_index = torch.arange(self.graph_tokens, device=self.device)   # every row of a decode batch
        self.decode_graphs = None   # captured below, once the KV cache they read exists
        self.mixed_graphs = None    # and the other steps' forward (mixed_graphs.py), after them
        if k and self.device_sampler is not None:   # verified positions' scratch, before the KV cache's share
            self.device_sampler.reserve_ahead(max_positions)
        self.num_kv_blocks = startup.size_kv_cache(self)
        self.kv_cache = kv_cache.allocate_kv_cache(self.model, self.num_kv_blocks, self.block_size,
                                                   self.num_kv_heads, self.head_dim, self.kv_cache_dtype, self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(self.num_kv_blocks)
        self.decode_graphs = startup.capture_decode_graphs(self)
        self.mixed_graphs = startup.capture_mixed_graphs(self)
        self.limits = StepLimits(max_seqs, max_tokens, self.max_model_len, self.vocab_size, self.block_size,
                                 self.num_kv_blocks, self.max_blocks_per_seq)
        self.instance_id = uuid.uuid4().hex
        logger.info(
            "model %s on %s (%s, attention %s): %d %s KV blocks of %d tokens, max_model_len %d, steps of up to "
            "%d tokens and %d requests", self.model_name, self.device, str(self.dtype).removeprefix("torch."),
            self.backend.name, self.num_kv_blocks, dtype_name(self.kv_cache_dtype), self.block_size,
            self.max_model_len, config.max_num_batched_tokens,
            config.max_num_seqs,
        )

    # --- public API ------------------------------------------------------------------------

    def describe(self) -> WorkerInfo:
        return WorkerInfo(
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
            kv_cache_dtype=dtype_name(self.kv_cache_dtype),
            instance_id=self.instance_id,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            features=self.features,
            speculative_method=self.config.speculative_method or "",
            num_speculative_tokens=self.num_speculative_tokens,
            max_held_requests=self.max_held_requests,
        )

    def step(self, step: StepInput) -> StepOutput:
        """Runs one step to the end: launch(step).result()."""
        return self.launch(step).result()

    def launch(self, step: StepInput) -> PendingStep:
        """Checks and applies the step and enqueues its forward and sampling; returns at once
        on a device that runs asynchronously. Raises InvalidStepError (a ValueError), before
        changing any state, when the step contradicts itself, the worker's limits or its batch.
        Every rank of a tensor-parallel group runs the same steps in the same order; only rank
        0's tokens are the answer."""
        started = time.perf_counter()
        if parallel_state.group_broken().is_set():
            raise RuntimeError("the tensor-parallel group is broken; this worker is exiting")
        # A speculating worker holds its batch until the step is launched: the replies of the steps
        # before it (settled here) go out only then, so their handling on the host (in one
        # process: the scheduler's too) runs while this step's kernels do, not between its launches.
        with self._batch_lock if self.bookkeeping is not None else contextlib.nullcontext():
            # What the steps in flight do not change is checked while they still run.
            cached_rows = check_requests(step, self.limits, self.batch)
            ahead = self._ahead_or_settle(step, cached_rows)
            batch, failed = self._prepare(step, cached_rows, ahead)
            if batch is None:
                pending = PendingStep(step.step_id, started, 0.0, 0.0, 0, None, None, None, None)
            else:
                prepared = time.perf_counter()
                try:
                    with self._eager_profile.around(step.step_id, batch, self._replays(batch)):
                        pending = self._execute(step.step_id, batch, started, (prepared - started) * 1e3)
                except Exception as exc:
                    if self.tp_size > 1:   # the other ranks are left waiting in a collective
                        parallel_state.mark_broken(f"step {step.step_id} failed: {exc!r}")
                    raise
        pending.failed += failed
        return pending

    def _ahead_or_settle(self, step: StepInput, cached_rows: np.ndarray) -> Ahead | None:
        """How to launch a verifying step before the step in flight is settled (spec_decode/ahead.py),
        or None once every step in flight is settled, where this step's rows depend on them."""
        if self.bookkeeping is None or (step.num_drafts is None and not self.bookkeeping.must_settle):
            return None
        ahead = plan_ahead(self, step, cached_rows)
        if ahead is None:
            self.bookkeeping.settle_all()
        return ahead

    def _prepare(self, step: StepInput, cached_rows: np.ndarray,
                 ahead: Ahead | None) -> tuple[StepBatch | None, list[RequestFailure]]:
        """Checks the rest of the step (launched ahead: plan_ahead did), applies it and prepares its inputs."""
        matchers, failed = ({}, []) if ahead else check_rows(step, cached_rows, self.limits, self.batch,
                                                             self.structured)
        rows, counts, drafts = self._apply(step, cached_rows, matchers)
        if self.device_sampler is not None:
            self.device_sampler.flush()
        if ahead is not None:
            return prepare_ahead(self, rows, ahead, step.propose_drafts), failed
        return (prepare_batch(self, rows, counts, drafts, step.propose_drafts) if len(rows) else None), failed

    def prepare_grammar(self, constraint: Constraint) -> None:
        """Compiles a constraint before its request's first step (StructuredOutput.prepare)."""
        if self.structured is None:
            raise InvalidStepError("only rank 0 of a group prepares grammars")
        self.structured.prepare(constraint)

    def reset(self) -> None:
        with self._batch_lock:
            for seq_id in self.batch.seq_ids():
                self._drop(seq_id)
        if self.structured is not None:
            self.structured.clear()

    def run_unchecked(self, step: StepInput) -> StepOutput:
        """Runs a step the runner made itself (start-up's warm-up), without the step checks."""
        rows, counts, drafts = self._apply(step, np.zeros(0, np.int64), {})
        batch = prepare_batch(self, rows, counts, drafts, step.propose_drafts)
        return self._execute(step.step_id, batch, time.perf_counter(), 0.0).result()

    def _replays(self, batch: StepBatch) -> bool:
        """Whether the step's forward replays a graph (the step profile's label)."""
        return batch.graph or (batch.meta is not None and self._graphs_for(batch.meta) is not None)

    def _graphs_for(self, meta: AttentionMetadata, aux_layers: tuple[int, ...] = ()):
        """The captured graphs whose `run` takes this step's forward, or None: it runs eagerly."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(meta):
            return self.decode_graphs
        if self.mixed_graphs is not None and not aux_layers and self.mixed_graphs.can_run(meta):
            return self.mixed_graphs
        return None

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  aux_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states of every token of the batch (with aux_layers, also those entering the
        drafter's aux layers, which an eagle3 worker's graphs write); pure-decode batches replay a
        CUDA graph, and so do the others where mixed graphs were captured."""
        graphs = self._graphs_for(meta, aux_layers)
        if graphs is None:
            return self.model(input_ids, positions, meta, aux_layers)
        hidden = graphs.run(input_ids, positions, meta)
        return (hidden, graphs.aux(len(hidden))) if aux_layers else hidden

    # --- a step ------------------------------------------------------------------------------

    def _apply(self, step: StepInput, cached_rows: np.ndarray,
               matchers: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Drops finished requests, admits new ones, appends blocks. Returns the step's rows, token
        counts and drafts to verify (None: none) in batch order: the cached requests, then the new ones."""
        for seq_id in step.finished_seq_ids:
            if seq_id in self.batch:     # unknown ids were never sent here or already dropped
                self._drop(seq_id)
        new_rows = []
        for new in step.new_requests:
            penalty_row = (self.sampler.add_request(new.token_ids, new.num_prompt_tokens, new.sampling)
                           if self.sampler is not None else None)
            row = self.batch.add(new, penalty_row, matchers.get(new.seq_id))
            if self.device_sampler is not None:   # its own penalty rows
                self.device_sampler.add(row, new.token_ids, new.num_prompt_tokens, new.sampling)
            new_rows.append(row)
        if len(step.new_block_indices):
            self.batch.append_blocks(cached_rows, step.new_block_indices, step.new_block_counts, step.new_block_ids)
        self._fit_last_sampled()
        drafts = step.num_drafts
        if not new_rows:
            return cached_rows, step.num_scheduled, drafts
        new_counts = [new.num_scheduled_tokens for new in step.new_requests]
        if drafts is not None:
            drafts = np.concatenate([drafts, np.zeros(len(new_rows), dtype=np.int64)])
        return (np.concatenate([cached_rows, np.array(new_rows, dtype=np.int64)]),
                np.concatenate([step.num_scheduled, np.array(new_counts, dtype=np.int64)]), drafts)

    def _fit_last_sampled(self) -> None:
        """Grows last_sampled when the batch (or the device sampler's table, dummy row last) did."""
        rows = self.batch.capacity
        if self.device_sampler is not None:
            rows = self.device_sampler.capacity + 1
        if rows <= len(self.last_sampled) and (self.device_sampler is None or rows == len(self.last_sampled)):
            return
        grown = self.last_sampled.new_zeros(rows)
        kept = min(rows, len(self.last_sampled)) - (self.device_sampler is not None)
        grown[:kept] = self.last_sampled[:kept]
        self.last_sampled = grown
        if self.decode_graphs is not None:   # they read the old tensor and the old dummy row
            self.decode_graphs.disable(f"the batch grew to {self.batch.capacity} rows")

    def _drop(self, seq_id: int) -> None:
        row = self.batch.row_of[seq_id]
        penalty_row = self.batch.remove(seq_id)
        if self.sampler is not None:
            self.sampler.remove_request(penalty_row)
        if self.device_sampler is not None:
            self.device_sampler.remove(row)

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
            device_start.record(self._staging.stream)
        # Constrained rows' masks are filled in the background while the forward runs.
        fill = (self.structured.start_fill(batch.constrained[1], batch.constrained_next_drafts)
                if batch.constrained is not None else None)
        extra = aux = tokens = None
        if batch.graph:   # every token of a staged step is sampled
            hidden = self.decode_graphs.replay(len(batch.position_rows))
            if batch.draft_plan is not None and self.drafter.aux_layers:
                aux = self.decode_graphs.aux(len(hidden))
        elif batch.draft_plan is not None and self.drafter.aux_layers:   # eagle3 reads them
            hidden, aux = self.run_model(batch.input_ids, batch.positions, batch.meta, self.drafter.aux_layers)
        else:
            hidden = self.run_model(batch.input_ids, batch.positions, batch.meta)
        if batch.scored is not None:
            extra = score_prompt(self.model.compute_logits, hidden, batch.score_indices, batch.score_targets,
                                 batch.scored, self.config.max_num_seqs)
        num_sampled = len(batch.position_rows)
        host_tokens = host_logprobs = release = None
        failed: list[RequestFailure] = []
        spec = batch.spec if num_sampled else None
        if num_sampled:
            tokens, logprobs, extra, failed = self._sample(batch, hidden, extra, fill)
        if batch.draft_plan is not None:
            drafts = self.drafter.run(self, batch, aux, tokens, spec is not None and spec.propose)
            if drafts is not None:   # kept on the device too, for a step launched before this one settles
                spec.device_drafts, spec.draft_counts = drafts
                # A host copy the next step's drafting cannot overwrite (on the CPU, to_host is the buffer).
                spec.drafts = to_host(drafts[0]) if drafts[0].is_cuda else drafts[0].clone()
        if num_sampled:
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
            event = step_done_event()
            event.record(self._staging.stream)
            self._staging.guard(event)   # behind this step's input copy too
        finish = None
        if spec is not None:
            spec.tokens, spec.event = host_tokens, event
            with self._batch_lock:
                self.bookkeeping.track(spec)
            finish = functools.partial(self.bookkeeping.finish, spec)
        forward_ms = (time.perf_counter() - launched) * 1e3
        pending = PendingStep(step_id, started, prepare_ms, forward_ms, num_sampled, host_tokens, host_logprobs,
                              event, release, device_start, extra, finish)
        pending.failed += failed
        return pending

    def _sample(self, batch: StepBatch, hidden: torch.Tensor, extra: Logprobs | None, fill: MaskFill | None):
        """(tokens, logprobs or None, extra, failed) of the step's sampled positions, on the device,
        with each row's newest token stored in last_sampled; failed: the constrained requests given
        up on (their masks cost more than the budget), whose tokens are void. A staged decode step
        without rows that need the host (a grammar's mask, top logprobs) samples inside its graph."""
        n = len(batch.position_rows)
        failed: list[RequestFailure] = []
        if batch.graph and self.decode_graphs.sample is not None and batch.constrained is None and batch.top_ks is None:
            tokens, logprobs = self.decode_graphs.replay_sample(n)
            return tokens, logprobs if self.device_sampler.wants_logprobs(batch.sampling_rows) else None, extra, failed
        logits = self.model.compute_logits(hidden, self._row_index[:n] if batch.graph else batch.logits_indices)
        if self.sampler is None and self.device_sampler is None:   # not rank 0: rank 0's tokens keep the rows equal
            tokens = broadcast_tokens(None, n, self.device)
            self._keep_newest(batch, None, tokens)
            return tokens, None, extra, failed
        if batch.constrained is not None:   # waits for the masks started before the forward
            failed = self.structured.mask(logits, batch.constrained[0], fill)
        if self.device_sampler is not None and batch.verify is None:
            tokens, logprobs = self._tokens[:n], self._logprobs[:n]
            self.device_sampler.sample(logits, batch.sampling_rows_device, tokens, logprobs, self.last_sampled)
            if not self.device_sampler.wants_logprobs(batch.sampling_rows):
                logprobs = None
        elif self.device_sampler is not None:
            tokens, logprobs = self._verify_on_device(batch, logits)
        else:
            meta = self._sampling_metadata(batch.position_rows)
            preceding = (preceding_drafts(batch.verify) if batch.verify is not None and meta.penalized_index is not None
                         else None)
            tokens, logprobs = self.sampler.sample(logits, meta, batch.seeded_output_indices, preceding,
                                                   record=batch.verify is None)
            tokens = broadcast_tokens(tokens, n, self.device)
            self._keep_newest(batch, meta, tokens)
        if batch.constrained is not None and batch.verify is None:
            self.structured.record(batch.constrained[1], tokens, batch.constrained[2])
        if batch.top_ks is not None:
            extra = extra or Logprobs()
            ids, values = top_logprobs(logits.index_select(0, batch.top_positions), int(batch.top_ks.max()))
            extra.top_ks, extra.top_ids, extra.top_values = batch.top_ks, to_host(ids), to_host(values)
        return tokens, logprobs, extra, failed

    def _keep_newest(self, batch: StepBatch, meta: SamplingMetadata | None, tokens: torch.Tensor) -> None:
        """Stores each sampling row's newest token in last_sampled (after a verification, its last
        emitted one)."""
        if batch.verify is None:
            self.last_sampled.index_copy_(0, batch.sampling_rows_device, tokens)
        else:
            self._apply_verification(batch, meta, tokens, batch.spec)

    def _verify_on_device(self, batch: StepBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A verifying step's positions drawn by the device sampler, each as its row will draw that
        output index with the drafts before it counted for penalties (the same tokens as without
        speculation), then accepted; (tokens, logprobs or None). A grammar's masks are in the logits
        by then, each position's for the grammar advanced over the drafts before it. Rows that take
        the argmax of their logits take just that."""
        n, sampler = len(batch.position_rows), self.device_sampler
        tokens, logprobs = self._tokens[:n], None
        if sampler.greedy(batch.position_rows):
            torch.argmax(logits, -1, out=tokens)
        else:
            logprobs = self._logprobs[:n]
            preceding = preceding_drafts(batch.verify) if sampler.processes(batch.position_rows) else None
            sampler.sample_ahead(logits, batch.verify_rows, batch.verify.offset, tokens, logprobs, preceding)
            if not sampler.wants_logprobs(batch.position_rows):
                logprobs = None
        self._apply_verification(batch, None, tokens, batch.spec)
        return tokens, logprobs

    def _apply_verification(self, batch: StepBatch, meta: SamplingMetadata | None, tokens: torch.Tensor,
                            spec: SpecStep | None) -> None:
        """After a step sampled every verified position (meta: the torch sampler's, None where the
        device sampler drew them or another rank did): each row's newest token is its last emitted
        one, and only emitted tokens count for penalties and grammars and move the draw counters."""
        accepted, emitted, last = accept(tokens, batch.verify)
        batch.accepted = accepted
        self.last_sampled.index_copy_(0, batch.sampling_rows_device, tokens.index_select(0, last))
        if meta is not None:
            self.sampler.record(meta, tokens, emitted)
        if self.device_sampler is not None:   # its next draws are keyed by the rows' new output indices
            if self.device_sampler.processes(batch.position_rows):
                self.device_sampler.count_emitted(batch.verify_rows, tokens, emitted)
            self.device_sampler.advance(batch.sampling_rows_device, accepted + 1)
        if batch.constrained is not None and self.structured is not None:
            self.structured.record(batch.constrained[1], tokens, batch.constrained[2], emitted)
        if spec is not None:
            spec.accepted, spec.device_accepted = to_host(accepted), accepted

    def sample_in_graph(self, hidden: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                        logprobs: torch.Tensor) -> None:
        """The decode graphs' sampling body: the LM head over every row, then the device sampler."""
        logits = self.model.compute_logits(hidden, self._row_index[:len(rows)])
        self.device_sampler.sample(logits, rows, tokens, logprobs, self.last_sampled)
