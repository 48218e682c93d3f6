"""Sampling on the device, from per-row options kept in device tensors (the Triton kernels are
layers/sampling_kernels.py, the passes and what they share; layers/sampling_cut.py, the top-k /
top-p / min-p cut; layers/sampling_finish.py, the last pass; layers/sampler.py is the torch path
and the reference).

The runner's persistent batch gives each request a row. `add` and `remove` write a row's options
into a host table; `flush` copies the rows that changed to the device, before the step that
needs them. A steady decode step, whose rows do not change, copies nothing: `sample` reads the
options by row, and the kernels advance each row's draw counter, store its token as the row's
newest (the next decode's input) and count it for its penalties, all on the device. `sample`
allocates nothing and never waits for the device, so a CUDA graph can capture it; `graph_key`
changes whenever a tensor it reads is reallocated (the table or the penalty state grew), and a
captured graph must then be captured again.

Draws are Gumbel-max with Philox noise keyed per row: a seeded request's key comes from its seed
and its counter starts at its output index, so its tokens depend on (seed, output index) and its
logits only, whatever else is in the batch, across preemptions too; an unseeded request's key
comes from the worker's seeded generator when it is admitted.

A step that verifies drafts (speculative decoding) samples each position of a verified run as its
row will draw that output index (`sample_ahead`, keyed by counter + offset), so a request's tokens
are the same whether they came one a step or in accepted runs; the runner commits the emitted ones
(`advance`, its newest token) once acceptance is known.
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple

import numpy as np
import torch
import triton

from common.sampling_bounds import MAX_LOGIT_BIAS_ENTRIES, seed_hash
from worker_svc.layers import sampling_cut, sampling_finish
from worker_svc.layers import sampling_kernels as kernels
from worker_svc.layers.penalties import PenaltyTable
from worker_svc.layers.sampler import SamplingMetadata, SamplingOptions, probabilities
from worker_svc.row_pool import RowPool, grown_capacity

logger = logging.getLogger(__name__)

CHUNK = 8192          # tokens of a row per program of the vocabulary-wide passes
SPLIT_PROGRAMS = 1024  # programs of a pass most rows skip: S per row, each over every S-th chunk
GATHER_CAP = 4096     # tokens a truncating row gathers, sorts and draws from (its kept set, with slack)
SORT_SIZES = (256, 1024)   # smaller sorts of a gathered set that fits them
GROUP_LANES = 2       # lanes of a scan tile's row whose maxima make one group (16 tokens at CHUNK 8192)
PLAN_ROUNDS = 16      # bisection steps of a truncating row's bound (30 nats / 2**16)
BRACKET_PIVOTS = 16   # pivots between a row's bound and its top, counted in one pass, when its gather overflows
NUM_PIVOTS = 4        # pivots the one-program search counts per pass over a row
MAX_ROUNDS = 24       # passes after which the one-program search keeps what it knows is kept
AHEAD_CHUNK = 64      # verified positions with scores to process drawn per pass (their scratch: ~9 bytes a token each)


def wanted(mode: str, device: torch.device, tensor_parallel_size: int) -> bool:
    """Whether a worker samples with these kernels (--sampler): kernels (also on the CPU, under
    Triton's interpreter: for tests), auto (on a GPU) or torch (layers/sampler.py). A
    tensor-parallel group samples with torch on rank 0, eagerly."""
    if tensor_parallel_size > 1 or mode == "torch":
        return False
    return mode == "kernels" or device.type == "cuda"


def _bits(value: float) -> int:
    return int(np.float32(value).view(np.int32))


class _State(NamedTuple):
    """What the kernels read per row besides the logits: entries, keys and counters (indexed by
    the rows given), processed-score rows (by an entry's slot), penalty state (by its penalty row)
    and logit biases (by the row)."""
    table: torch.Tensor
    keys: torch.Tensor
    counters: torch.Tensor
    processed: torch.Tensor
    prompt_mask: torch.Tensor
    counts: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor


class DeviceSampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0, capacity: int = 256,
                 max_rows: int = 256, chunk: int = CHUNK, gather_cap: int = GATHER_CAP,
                 split_programs: int = SPLIT_PROGRAMS) -> None:
        if chunk % 4:
            raise ValueError(f"chunk must be a multiple of 4, got {chunk}")
        if gather_cap & (gather_cap - 1):
            raise ValueError(f"gather_cap must be a power of 2, got {gather_cap}")
        self.vocab_size, self.device = vocab_size, device
        self.chunk = min(chunk, -(-vocab_size // 4) * 4)
        self.gather_cap, self.split_programs = gather_cap, split_programs
        self.num_chunks = -(-vocab_size // self.chunk)
        self._tile = min(256, triton.next_power_of_2(self.chunk) // 4)   # [tile, 4] tokens per step
        self._groups = self._tile * 4 // GROUP_LANES                      # group maxima per chunk
        self._rng = np.random.default_rng(seed)
        self.penalties = PenaltyTable(vocab_size, device)
        self._slots = RowPool()
        self.processed = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
        self._options: list[SamplingOptions | None] = []
        self.capacity = 0
        self._grow_table(capacity)
        self.max_rows = 0
        self._grow_scratch(max_rows)
        self._grow_ahead(0)
        self._grow_ahead_processed(0)

    # --- rows ------------------------------------------------------------------------------------

    @property
    def dummy_row(self) -> int:
        """A greedy row with no options, for the padding of a captured batch."""
        return self.capacity

    def add(self, row: int, token_ids: list[int], num_prompt_tokens: int, options: SamplingOptions) -> None:
        """The request now in `row`: its options, penalty state and draw counter (its output index)."""
        if row >= self.capacity:
            self._grow_table(grown_capacity(max(self.capacity, 1), row + 1))
        entry = np.zeros(kernels.NUM_COLUMNS, np.int32)
        flags = kernels.F_GREEDY.value if options.greedy else 0
        if options.logprobs:
            flags |= kernels.F_LOGPROB.value
        penalty_row = slot = -1
        if options.has_penalties:
            flags |= kernels.F_PENALTY.value | kernels.F_PROCESSED.value
            penalty_row = self.penalties.add(token_ids[:num_prompt_tokens], token_ids[num_prompt_tokens:])
        ids, values = options.bias_entries
        if ids:
            flags |= kernels.F_PROCESSED.value
            self._bias_ids[row, :len(ids)] = ids
            self._bias_values[row, :len(ids)] = values
        if flags & kernels.F_PROCESSED.value:
            slot = self._slots.acquire()
            self._ensure_processed(self._slots.high_water)
        if not options.greedy:
            flags |= self._truncation(options, entry)
        entry[[kernels.C_FLAGS.value, kernels.C_PENALTY_ROW.value, kernels.C_SLOT.value,
               kernels.C_NUM_BIAS.value]] = (flags, penalty_row, slot, len(ids))
        entry[kernels.C_INV_TEMPERATURE.value] = _bits(1.0 if options.greedy else 1.0 / options.temperature)
        entry[kernels.C_REPETITION.value] = _bits(options.repetition_penalty)
        entry[kernels.C_PRESENCE.value] = _bits(options.presence_penalty)
        entry[kernels.C_FREQUENCY.value] = _bits(options.frequency_penalty)
        self._table[row] = entry
        self._keys[row] = self._key(options.seed)
        self._counters[row] = len(token_ids) - num_prompt_tokens
        self._options[row] = options
        self._dirty.add(row)

    def remove(self, row: int) -> None:
        entry = self._table[row]
        if entry[kernels.C_PENALTY_ROW.value] >= 0:
            self.penalties.release(int(entry[kernels.C_PENALTY_ROW.value]))
        if entry[kernels.C_SLOT.value] >= 0:
            self._slots.release(int(entry[kernels.C_SLOT.value]))
        self._table[row] = self._table[self.dummy_row]
        self._options[row] = None

    def flush(self) -> None:
        """Copies the rows added since the last flush to the device (stream-ordered before what
        is enqueued next; nothing waits)."""
        if not self._dirty:
            return
        rows = np.array(sorted(self._dirty), dtype=np.int64)
        self._dirty.clear()
        index = torch.from_numpy(rows).to(self.device, non_blocking=True)
        for device_table, host_table in ((self.table, self._table), (self.keys, self._keys),
                                         (self.counters, self._counters), (self.bias_ids, self._bias_ids),
                                         (self.bias_values, self._bias_values)):
            device_table.index_copy_(0, index, torch.from_numpy(host_table[rows]).to(self.device, non_blocking=True))

    def advance(self, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Moves the rows' draw counters past `counts` tokens a verification emitted for them
        (sample_ahead's), so that each row's next draw is keyed by its output index."""
        self.counters.index_add_(0, rows, counts.to(self.counters.dtype))

    def wants_logprobs(self, rows: np.ndarray) -> bool:
        return bool(np.any(self._table[rows, kernels.C_FLAGS.value] & kernels.F_LOGPROB.value))

    def graph_key(self) -> tuple:
        """Changes whenever a tensor that `sample` reads is reallocated."""
        return (self.table.data_ptr(), self.processed.data_ptr(), self.penalties.prompt_mask.data_ptr(),
                self.penalties.output_counts.data_ptr(), self.part_f.data_ptr())

    # --- sampling --------------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
               last_sampled: torch.Tensor) -> None:
        """Samples logits [n, vocab] (any float dtype; not modified) of the batch rows `rows` (int64
        [n], on the device) into tokens (int64 [n]) and logprobs (float32 [n]: of the logits as
        given; 0 where not asked), and stores each token at last_sampled[row]. Rows must be flushed."""
        self._launch(logits, rows, self._state(), tokens, logprobs, last_sampled)

    def processes(self, rows: np.ndarray) -> bool:
        """Whether any of these rows has scores to process (penalties, a logit bias)."""
        return bool(np.any(self._table[rows, kernels.C_FLAGS.value] & kernels.F_PROCESSED.value))

    def greedy(self, rows: np.ndarray) -> bool:
        """Whether every one of these rows takes the argmax of its logits as given (greedy, with no
        scores to process and no logprob asked): torch.argmax is then their whole sampling."""
        flags = self._table[rows, kernels.C_FLAGS.value]
        return bool(np.all((flags & (kernels.F_GREEDY.value | kernels.F_PROCESSED.value | kernels.F_LOGPROB.value))
                           == kernels.F_GREEDY.value))

    def sample_ahead(self, logits: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, tokens: torch.Tensor,
                     logprobs: torch.Tensor, preceding: torch.Tensor | None = None) -> None:
        """Samples logits row i as batch row rows[i] will draw the token offsets[i] outputs after
        its next (a verified run's positions, several a row: spec_decode/verification.py), each with
        the noise of that output index and, for rows with penalties, counting `preceding[i]` (the
        drafts before it, -1 padded) as output; and changes nothing: no draw counter moves, no token
        is counted or stored as a row's newest (once the emitted tokens are known, advance(),
        count_emitted() and the caller do that). Runs the kernels of `sample` over a copy of the
        rows' entries, one a position, counters moved by the offsets; `preceding` (given when a row
        has scores to process: `processes`) also gives each position a scratch row of processed
        scores and of penalty state. Allocates nothing once its scratch holds n positions. Rows must
        be flushed."""
        n = logits.shape[0]
        if preceding is not None and n > AHEAD_CHUNK:   # the scratch holds AHEAD_CHUNK positions
            for at in range(0, n, AHEAD_CHUNK):
                part = slice(at, at + AHEAD_CHUNK)
                self.sample_ahead(logits[part], rows[part], offsets[part], tokens[part], logprobs[part],
                                  preceding[part])
            return
        if n > len(self._ahead_index):
            self._grow_ahead(n)
        index = self._ahead_index[:n]
        table, keys, counters = self._ahead_table[:n], self._ahead_keys[:n], self._ahead_counters[:n]
        torch.index_select(self.table, 0, rows, out=table)
        torch.index_select(self.keys, 0, rows, out=keys)
        torch.index_select(self.counters, 0, rows, out=counters)
        counters.add_(offsets)
        state = self._state()._replace(table=table, keys=keys, counters=counters)
        if preceding is not None:
            state = self._processed_ahead(state, rows, preceding, n)
        self._launch(logits, index, state, tokens, logprobs, self._ahead_newest)

    def reserve_ahead(self, positions: int) -> None:
        """sample_ahead's scratch for steps of up to `positions` verified positions, made now (before
        the KV cache takes the memory left) rather than by the first such step."""
        if positions > len(self._ahead_index):
            self._grow_ahead(positions)
        if min(positions, AHEAD_CHUNK) > self._ahead_processed.shape[0]:
            self._grow_ahead_processed(min(positions, AHEAD_CHUNK))

    def count_emitted(self, rows: torch.Tensor, tokens: torch.Tensor, emitted: torch.Tensor) -> None:
        """Counts the emitted ones of sample_ahead's tokens (rows: each one's batch row) into their
        rows' penalty state; rows without penalties count nothing."""
        penalty_rows = self.table[:, kernels.C_PENALTY_ROW.value].index_select(0, rows).long()
        keep = emitted & (penalty_rows >= 0)
        self.penalties.record(penalty_rows.clamp_min(0), tokens, keep)

    def _processed_ahead(self, state: "_State", rows: torch.Tensor, preceding: torch.Tensor, n: int) -> "_State":
        """Each position's own processed-scores row and penalty state (its row's, with the drafts
        before it counted), and its row's logit bias: the entries copied point at them."""
        if n > self._ahead_processed.shape[0]:
            self._grow_ahead_processed(n)
        table, index = state.table, self._ahead_index[:n]
        penalty_rows = table[:, kernels.C_PENALTY_ROW.value].long().clamp_min(0)
        mask, counts = self._ahead_mask[:n], self._ahead_counts[:n]
        torch.index_select(self.penalties.prompt_mask, 0, penalty_rows, out=mask)
        torch.index_select(self.penalties.output_counts, 0, penalty_rows, out=counts)
        counts.scatter_add_(1, preceding.clamp_min(0), (preceding >= 0).to(counts.dtype))
        bias_ids, bias_values = self._ahead_bias_ids[:n], self._ahead_bias_values[:n]
        torch.index_select(self.bias_ids, 0, rows, out=bias_ids)
        torch.index_select(self.bias_values, 0, rows, out=bias_values)
        table[:, kernels.C_SLOT.value] = index
        table[:, kernels.C_PENALTY_ROW.value] = index
        return state._replace(processed=self._ahead_processed[:n], prompt_mask=mask, counts=counts, bias_ids=bias_ids,
                              bias_values=bias_values)

    def _state(self) -> _State:
        """The rows' own state, as the kernels of a plain step read it."""
        return _State(self.table, self.keys, self.counters, self.processed, self.penalties.prompt_mask,
                      self.penalties.output_counts, self.bias_ids, self.bias_values)

    def _launch(self, logits: torch.Tensor, rows: torch.Tensor, state: "_State", tokens: torch.Tensor,
                logprobs: torch.Tensor, last_sampled: torch.Tensor) -> None:
        """The kernels of one sampling, reading each logits row's entry, key, counter and state at rows[i]."""
        n, vocab = logits.shape
        if logits.stride(1) != 1:
            raise ValueError("logits must be contiguous along the vocabulary")
        if n > self.max_rows:
            self._grow_scratch(n)
        grid = (n, self.num_chunks)
        split = (n, max(1, min(self.num_chunks, self.split_programs // n)))   # for the passes most rows skip
        chunks = triton.next_power_of_2(self.num_chunks)
        table, keys, counters, processed = state.table, state.keys, state.counters, state.processed
        block = min(1024, 4 * self._tile)
        kernels._penalize_kernel[split](
            logits, logits.stride(0), processed, rows, table, state.prompt_mask,
            state.counts, state.bias_ids, state.bias_values, vocab, self.chunk, self.num_chunks,
            MAX_BIAS=MAX_LOGIT_BIAS_ENTRIES, BLOCK=block, num_warps=4)
        kernels._scan_kernel[grid](
            logits, logits.stride(0), processed, rows, table, keys, counters,
            self.part_f, self.part_i, self.groups, vocab, self.chunk, self.num_chunks, G=self._tile,
            LANES=GROUP_LANES, BLOCK=block, num_warps=8)
        sampling_cut._plan_kernel[(n,)](
            rows, table, self.part_f, self.part_i, self.groups, self.plan_f, self.plan_i, self.num_chunks,
            CHUNKS=chunks, GROUPS=self._groups, ROUNDS=PLAN_ROUNDS, num_warps=16 if chunks * self._groups > 8192 else 8)
        sampling_cut._gather_kernel[split](
            logits, logits.stride(0), processed, rows, table, keys, counters, self.part_f,
            self.part_i, self.plan_f, self.plan_i, self.gathered, self.gathered_ids, vocab, self.chunk, self.num_chunks,
            CAP=self.gather_cap, G=min(128, self._tile), BLOCK=block, num_warps=4)
        sampling_cut._pivot_kernel[split](
            logits, logits.stride(0), processed, rows, table, self.plan_f, self.plan_i, self.pivot_n,
            self.pivot_m, vocab, self.chunk, self.num_chunks, CAP=self.gather_cap, P=BRACKET_PIVOTS,
            BLOCK=min(512, block), num_warps=4)
        sampling_cut._bracket_kernel[split](
            logits, logits.stride(0), processed, rows, table, keys, counters, self.part_f,
            self.part_i, self.plan_f, self.plan_i, self.pivot_n, self.pivot_m, self.gathered, self.gathered_ids,
            vocab, self.chunk, self.num_chunks, CAP=self.gather_cap, CHUNKS=chunks, P=BRACKET_PIVOTS,
            G=min(128, self._tile), BLOCK=block, num_warps=4)
        sampling_finish._finish_kernel[(n,)](
            logits, logits.stride(0), processed, rows, table, keys, counters,
            state.counts, self.part_f, self.part_i, self.plan_f, self.plan_i, self.pivot_n,
            self.pivot_m, self.gathered, self.gathered_ids, tokens, logprobs, last_sampled, self.cuts, vocab,
            self.num_chunks, CHUNKS=chunks, G=self._tile, BLOCK=min(512, block), BRACKET_PIVOTS=BRACKET_PIVOTS,
            NUM_PIVOTS=NUM_PIVOTS,
            CAP=self.gather_cap, SMALL=min(SORT_SIZES[0], self.gather_cap), MID=min(SORT_SIZES[1], self.gather_cap),
            MAX_ROUNDS=MAX_ROUNDS, num_warps=16)

    def cut_paths(self, n: int) -> list[str]:
        """How each of the last call's first n rows found its cut (benchmarks and tests; waits for
        the device): "gathered" (its kept set fit the buffer), "bracketed" (pivots, then the
        bracket), "alone" (the one-program search), "min-p" (min-p alone), "none" (no truncation)."""
        plan = self.plan_i.view(-1, kernels.NUM_PLAN)[:n].tolist()
        paths = []
        for (mode, gathered, _, _), cut in zip(plan, self.cuts[:n].tolist()):
            if mode != kernels.MODE_GATHER.value:
                paths.append("min-p" if mode == kernels.MODE_MIN_P.value else "none")
            else:
                paths.append("alone" if math.isnan(cut) else "gathered" if gathered <= self.gather_cap else "bracketed")
        return paths

    def probabilities(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """The distribution each row would draw from ([n, vocab] float32; greedy rows one-hot), by
        the torch reference (layers/sampler.py) with this sampler's penalty state."""
        options = [self._options[r] for r in rows.tolist()]
        penalty_rows = [int(self._table[r, kernels.C_PENALTY_ROW.value]) for r in rows.tolist()]
        meta = SamplingMetadata.build(options, [p if p >= 0 else None for p in penalty_rows], self.vocab_size,
                                      self.device)
        return probabilities(logits, meta, self.penalties)

    # --- storage ---------------------------------------------------------------------------------

    def _truncation(self, options: SamplingOptions, entry: np.ndarray) -> int:
        flags = 0
        if 0 < options.top_k < self.vocab_size:
            flags |= kernels.F_TOP_K.value
            entry[kernels.C_TOP_K.value] = options.top_k
        if options.top_p < 1.0:
            flags |= kernels.F_TOP_P.value
            entry[kernels.C_TOP_P.value] = _bits(options.top_p)
        if options.min_p > 0.0:
            flags |= kernels.F_MIN_P.value
            entry[kernels.C_LOG_MIN_P.value] = _bits(math.log(options.min_p))
        return flags

    def _key(self, seed: int | None) -> int:
        """The row's Philox key: from the seed, or a fresh draw of the worker's generator."""
        if seed is None:
            return int(self._rng.integers(0, 2 ** 63))
        return seed_hash(seed, 2 ** 64 - 1) & (2 ** 63 - 1)

    def _grow_table(self, capacity: int) -> None:
        """Room for `capacity` rows and the dummy row after them."""
        old = self.capacity
        rows = capacity + 1
        host = np.zeros((rows, kernels.NUM_COLUMNS), np.int32)
        keys, counters = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        bias_ids = np.zeros((rows, MAX_LOGIT_BIAS_ENTRIES), np.int32)
        bias_values = np.zeros((rows, MAX_LOGIT_BIAS_ENTRIES), np.float32)
        host[capacity, kernels.C_FLAGS.value] = kernels.F_GREEDY.value
        host[capacity, kernels.C_INV_TEMPERATURE.value] = _bits(1.0)
        host[capacity, [kernels.C_PENALTY_ROW.value, kernels.C_SLOT.value]] = -1
        device_counters = torch.zeros(rows, dtype=torch.int64, device=self.device)
        if old:
            host[:old], keys[:old], counters[:old] = self._table[:old], self._keys[:old], self._counters[:old]
            bias_ids[:old], bias_values[:old] = self._bias_ids[:old], self._bias_values[:old]
            device_counters[:old] = self.counters[:old]   # the device advances them: keep its values
        self._table, self._keys, self._counters = host, keys, counters
        self._bias_ids, self._bias_values = bias_ids, bias_values
        self._options += [None] * (rows - len(self._options))
        self.capacity = capacity
        self.table = torch.from_numpy(host).to(self.device)
        self.keys = torch.from_numpy(keys).to(self.device)
        self.counters = device_counters
        self.bias_ids = torch.from_numpy(bias_ids).to(self.device)
        self.bias_values = torch.from_numpy(bias_values).to(self.device)
        if not old:
            self._dirty: set[int] = set()
        if old:
            logger.info("sampling table grew to %d rows", capacity)

    def _ensure_processed(self, slots: int) -> None:
        if slots > self.processed.shape[0]:
            grown = grown_capacity(self.processed.shape[0], slots)
            self.processed = torch.zeros(grown, self.vocab_size, dtype=torch.float32, device=self.device)

    def _grow_ahead(self, positions: int) -> None:
        """sample_ahead's copies of the rows' entries, one a position, and where its kernels store
        each position's token as if it were a row's newest (read by nobody)."""
        with torch.device(self.device):
            self._ahead_index = torch.arange(positions, dtype=torch.int64)
            self._ahead_table = torch.zeros(positions, kernels.NUM_COLUMNS, dtype=torch.int32)
            self._ahead_keys = torch.zeros(positions, dtype=torch.int64)
            self._ahead_counters = torch.zeros(positions, dtype=torch.int64)
            self._ahead_newest = torch.zeros(positions, dtype=torch.int64)

    def _grow_ahead_processed(self, positions: int) -> None:
        """sample_ahead's per-position scratch for rows with scores to process (a row of processed
        scores, prompt mask and counts, and the row's logit bias, per position of a pass)."""
        with torch.device(self.device):
            self._ahead_processed = torch.zeros(positions, self.vocab_size, dtype=torch.float32)
            self._ahead_mask = torch.zeros(positions, self.vocab_size, dtype=self.penalties.prompt_mask.dtype)
            self._ahead_counts = torch.zeros(positions, self.vocab_size, dtype=self.penalties.output_counts.dtype)
            self._ahead_bias_ids = torch.zeros(positions, MAX_LOGIT_BIAS_ENTRIES, dtype=self.bias_ids.dtype)
            self._ahead_bias_values = torch.zeros(positions, MAX_LOGIT_BIAS_ENTRIES, dtype=self.bias_values.dtype)

    def _grow_scratch(self, rows: int) -> None:
        self.max_rows = rows
        parts = rows * self.num_chunks * kernels.NUM_PARTS
        self.part_f = torch.zeros(parts, dtype=torch.float32, device=self.device)
        self.part_i = torch.zeros(parts, dtype=torch.int32, device=self.device)
        self.groups = torch.zeros(rows * self.num_chunks * self._groups, dtype=torch.float32, device=self.device)
        self.plan_f = torch.zeros(rows * kernels.NUM_PLAN, dtype=torch.float32, device=self.device)
        self.plan_i = torch.zeros(rows * kernels.NUM_PLAN, dtype=torch.int32, device=self.device)
        self.pivot_n = torch.zeros(rows * self.num_chunks * BRACKET_PIVOTS, dtype=torch.int32, device=self.device)
        self.pivot_m = torch.zeros(rows * self.num_chunks * BRACKET_PIVOTS, dtype=torch.float32, device=self.device)
        self.gathered = torch.zeros(rows * self.gather_cap, dtype=torch.float32, device=self.device)
        self.gathered_ids = torch.zeros(rows * self.gather_cap, dtype=torch.int32, device=self.device)
        self.cuts = torch.zeros(rows, dtype=torch.float32, device=self.device)   # each row's cut (tests read it)
