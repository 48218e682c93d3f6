"""Step checks: a step against the worker's limits and its persistent batch, before anything changes.

`check_step` refuses a step that contradicts itself, the limits or the batch with an
InvalidStepError naming the step, the request and the field (a StaleMirrorError when the batch
and the scheduler's view differ: a request not held, or held twice). The cached requests are
checked as columns, vectorised over rows; new requests one by one. A new request's grammar
matcher is made here; a request whose grammar fails comes back as a RequestFailure (run
unconstrained in this step, its token void, the scheduler ends it) and the rest of the step goes on.
It runs in two halves, `check_requests` and `check_rows`, so that a speculating worker checks the
first while the steps before this one still run (their acceptance changes only the rows' counts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker_svc.input_batch import InputBatch
from worker_svc.runner_io import InvalidStepError, NewRequest, RequestFailure, StaleMirrorError, StepInput


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The most a step may ask of this worker."""
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    max_blocks_per_seq: int          # max_model_len / block_size, rounded up


def check_step(step: StepInput, limits: StepLimits, batch: InputBatch,
               structured) -> tuple[np.ndarray, dict, list[RequestFailure]]:
    """Checks the whole step; returns the cached requests' rows, the new requests' grammar
    matchers by seq_id (`structured` makes them; None on ranks that do not sample), and the new
    requests whose grammar failed."""
    rows = check_requests(step, limits, batch)
    return rows, *check_rows(step, rows, limits, batch, structured)


def check_requests(step: StepInput, limits: StepLimits, batch: InputBatch) -> np.ndarray:
    """The step's first half: what no step in flight changes (which requests the batch holds, the
    step's sizes, the new requests); returns the cached requests' rows. A speculating worker runs
    it before it waits for the steps before this one to be settled."""
    sid = step.step_id
    if step.num_requests > limits.max_num_seqs:
        raise InvalidStepError(f"step {sid}: {step.num_requests} requests exceed max_num_seqs {limits.max_num_seqs}")
    finished = set(step.finished_seq_ids)
    cached_ids = step.cached_seq_ids
    try:
        rows = batch.rows_of(cached_ids)
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
    if step.num_drafts is not None:
        num_tokens += int(step.num_drafts.sum())
    for new in step.new_requests:
        num_tokens += _check_new(sid, new, limits, batch, seen, finished)
    if num_tokens > limits.max_num_batched_tokens:
        raise InvalidStepError(f"step {sid}: {num_tokens} tokens exceed max_num_batched_tokens "
                               f"{limits.max_num_batched_tokens}")
    return rows


def check_rows(step: StepInput, rows: np.ndarray, limits: StepLimits, batch: InputBatch,
               structured) -> tuple[dict, list[RequestFailure]]:
    """The step's second half: the cached requests against their rows' counts and drafts (as the
    steps before left them); then the new requests' grammar matchers and failures (check_step)."""
    if len(rows):
        _check_cached(step, rows, limits, batch)
    if structured is None:
        return {}, []
    return _matchers(step, structured)


def _check_new(sid: int, new: NewRequest, limits: StepLimits, batch: InputBatch, seen: set[int],
               finished: set[int]) -> int:
    """One new request; returns the tokens it schedules."""
    where = f"step {sid}, new request {new.seq_id}"
    if new.seq_id in seen:
        raise InvalidStepError(f"{where}: listed twice in one step")
    seen.add(new.seq_id)
    if new.seq_id in batch and new.seq_id not in finished:
        raise StaleMirrorError(f"{where}: already running here; list it in finished_seq_ids to re-send it")
    known = len(new.token_ids)
    if not 0 < new.num_prompt_tokens <= known:
        raise InvalidStepError(f"{where}: num_prompt_tokens {new.num_prompt_tokens} not in 1..{known} (token_ids)")
    if known > limits.max_model_len:
        raise InvalidStepError(f"{where}: {known} tokens exceed max_model_len {limits.max_model_len}")
    if max(new.token_ids) >= limits.vocab_size:
        raise InvalidStepError(f"{where}: token id {max(new.token_ids)} >= vocab_size {limits.vocab_size}")
    try:
        new.sampling.check_token_ids(limits.vocab_size)
    except ValueError as exc:
        raise InvalidStepError(f"{where}: {exc}") from None
    if new.num_scheduled_tokens == 0:
        raise InvalidStepError(f"{where}: num_scheduled_tokens is 0")
    end = new.num_computed_tokens + new.num_scheduled_tokens
    if end > known:
        raise InvalidStepError(f"{where}: scheduling past the known tokens ({new.num_computed_tokens} computed + "
                               f"{new.num_scheduled_tokens} scheduled > {known} known)")
    blocks = new.block_ids
    if blocks and max(blocks) >= limits.num_kv_blocks:
        raise InvalidStepError(f"{where}: block id {max(blocks)} out of range (the cache has {limits.num_kv_blocks})")
    if len(blocks) > limits.max_blocks_per_seq:
        raise InvalidStepError(f"{where}: {len(blocks)} blocks exceed {limits.max_blocks_per_seq} (max_model_len "
                               f"{limits.max_model_len} / block_size {limits.block_size})")
    if len(blocks) * limits.block_size < end:
        raise InvalidStepError(f"{where}: {len(blocks)} blocks of {limits.block_size} cannot hold {end} tokens")
    return new.num_scheduled_tokens


def _check_cached(step: StepInput, rows: np.ndarray, limits: StepLimits, batch: InputBatch) -> None:
    """The cached columns against the rows, vectorised; the message names the first offender."""
    sid, b = step.step_id, batch

    def refuse(bad: np.ndarray, why) -> None:
        i = int(np.flatnonzero(bad)[0])
        raise InvalidStepError(f"step {sid}, cached request {step.cached_seq_ids[i]}: {why(i)}")

    counts = step.num_scheduled
    start = b.num_computed[rows]
    end = start + counts
    num_tokens = b.num_tokens[rows]
    # Sampled tokens are known on the device only as each row's newest: a step may compute
    # the newest, never an older one the host does not have.
    num_host = b.num_host_tokens[rows]
    past = end > num_tokens
    unknown = np.maximum(start, num_host) < np.minimum(end, num_tokens - 1)
    if step.num_drafts is not None:   # its checks read the positions as these leave them
        _refuse_positions(refuse, past, unknown, start, counts, num_tokens, num_host, end)
        end = end + _check_drafts(step, rows, limits, batch, start, counts, refuse)
    num_blocks = b.num_blocks[rows]
    bad_id = False
    if len(step.new_block_indices):
        bad_id = step.new_block_ids.max() >= limits.num_kv_blocks
        if not bad_id:   # (rows index a copy)
            num_blocks[step.new_block_indices] += step.new_block_counts
    too_many = num_blocks > limits.max_blocks_per_seq
    short = num_blocks * limits.block_size < end
    # One test for the common case (nothing wrong); the first offender, in this order, otherwise.
    if not bad_id and not (past | unknown | too_many | short).any():
        return
    _refuse_positions(refuse, past, unknown, start, counts, num_tokens, num_host, end)
    if bad_id:
        raise InvalidStepError(f"step {sid}: block id {int(step.new_block_ids.max())} out of range (the cache has "
                               f"{limits.num_kv_blocks})")
    if too_many.any():
        refuse(too_many, lambda i: f"{num_blocks[i]} blocks exceed {limits.max_blocks_per_seq} (max_model_len "
                                   f"{limits.max_model_len} / block_size {limits.block_size})")
    refuse(short, lambda i: f"{num_blocks[i]} blocks of {limits.block_size} cannot hold {end[i]} tokens")


def _refuse_positions(refuse, past, unknown, start, counts, num_tokens, num_host, end) -> None:
    """The first cached request scheduled past its known tokens, else the first computing an older sampled token
    than its newest (`end` as before drafts; once these passed, drafts add to it without changing either)."""
    if past.any():
        refuse(past, lambda i: f"scheduling past the known tokens ({start[i]} computed + {counts[i]} scheduled > "
                               f"{num_tokens[i]} known)")
    if unknown.any():
        refuse(unknown, lambda i: f"positions {max(start[i], num_host[i])}..{end[i] - 1} include sampled tokens "
                                  f"older than the newest (re-send it as a NewRequest)")


def _check_drafts(step: StepInput, rows: np.ndarray, limits: StepLimits, batch: InputBatch, start: np.ndarray,
                  counts: np.ndarray, refuse) -> np.ndarray:
    """Entries that verify drafts: each a decode of its newest token, verifying the drafts this
    worker holds for it up to the count asked (a scheduler that scheduled this step before the
    last one's answer asks for the most it may hold), within max_model_len. Fits step.num_drafts to
    them and returns it."""
    drafts = step.num_drafts
    drafted = drafts > 0
    not_decode = drafted & ((counts != 1) | (start + counts != batch.num_tokens[rows]))
    if np.any(not_decode):
        refuse(not_decode, lambda i: "verifies drafts but does not decode its newest token")
    np.minimum(drafts, batch.num_drafts[rows], out=drafts)
    too_long = start + counts + drafts > limits.max_model_len
    if np.any(too_long):
        refuse(too_long, lambda i: f"{drafts[i]} drafts from position {start[i] + 1} pass max_model_len "
                                   f"{limits.max_model_len}")
    return drafts


def _matchers(step: StepInput, structured) -> tuple[dict, list[RequestFailure]]:
    """Grammar matchers of the new requests that carry a constraint, by seq_id, and the requests
    whose grammar failed."""
    matchers, failed = {}, []
    for new in step.new_requests:
        if new.sampling.constraint is not None:
            matcher = structured.matcher_or_failure(new.seq_id, new.sampling.constraint, new.output_token_ids)
            if isinstance(matcher, RequestFailure):
                failed.append(matcher)
            else:
                matchers[new.seq_id] = matcher
    return matchers, failed
