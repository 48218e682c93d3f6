"""A verifying step launched ahead of the acceptance of the step before it.

A step that verifies drafts depends on the step before it (still running) only through what that
step accepted: each row's start moves back by the drafts it rejected, and its inputs are its last
emitted token and the drafts made after it, all on the device by then. In the common case (every row
decodes its newest token after that step, which sampled it and drafted on the device; nothing needs
the host's tokens: no grammar, top logprobs, prompt scoring or seeded torch draw; no request joins
or leaves) the host stages what holds for any acceptance (the rows, each row's start were every
draft accepted, block tables that wide, the drafts each verifies) and one kernel derives positions,
slots, input ids, lengths, the drafts to verify and the drafting plan's start on the device. The
host's counts move once the step before is settled (Bookkeeping's `advance`), ending as if this step
had been prepared after that settle. Unless the step checks pass for every acceptance, `plan_ahead`
says None: the step settles first and is prepared as before (batch_prep.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

from worker_svc.batch_prep import spec_step, verifies_as_decodes
from worker_svc.layers.attention import AttentionMetadata
from worker_svc.spec_decode.bookkeeping import SpecStep
from worker_svc.spec_decode.verification import DeviceLayout, VerifyLayout
from worker_svc.step_batch import StepBatch

if TYPE_CHECKING:
    from worker_svc.model_runner import ModelRunner
    from worker_svc.runner_io import StepInput


@dataclass
class Ahead:
    """How a step is launched ahead: the step in flight, each row's place among its sampling rows,
    and the drafts each row verifies."""
    prev: SpecStep
    index: np.ndarray
    num_drafts: np.ndarray


def plan_ahead(runner: ModelRunner, step: StepInput, rows: np.ndarray) -> Ahead | None:
    """How to launch this step before the step in flight is settled, or None (settle first). Fits
    step.num_drafts to the drafts each row will hold, as the step checks would."""
    b = runner.batch
    if (step.num_drafts is None or step.new_requests or step.finished_seq_ids or runner.drafter is None
            or not len(rows) or b.num_top_logprobs or b.num_scoring
            or not _derivable(runner) or np.any(step.num_scheduled != 1)):
        return None
    prev = runner.bookkeeping.only_in_flight()
    if prev is None or (prev.layout is not None and prev.device_accepted is None):
        return None
    index = _places(prev.rows, rows)
    if index is None or np.any(b.generation[rows] != prev.generations[index]):
        return None
    held = np.zeros(len(rows), np.int64)
    if prev.device_drafts is not None:
        held = np.where(prev.proposable[index], prev.draft_counts[index], 0)
    rejectable = prev.layout.num_drafts[index] if prev.layout is not None else 0
    # The drafts a row holds once settled are cut to its room: only when every acceptance leaves room.
    if np.any((held > 0) & (b.num_tokens[rows] + rejectable + held > runner.max_model_len)):
        return None
    drafts = np.minimum(step.num_drafts, held)
    if not _fits(runner, step, rows, b.num_computed[rows] + 1 + drafts):
        return None
    if not verifies_as_decodes(runner, step.num_scheduled, len(rows) + int(drafts.sum())):
        return None
    # From the requests' options, which every rank holds (only rank 0 holds grammar matchers and a
    # sampler), so that the ranks of a group take the same path: a grammar's masks follow the host's
    # tokens; the torch sampler draws a seeded position by its output index, known on the host.
    seeded_on_host = not runner.samples_on_device
    for r in rows.tolist():
        options = b.options[r]
        if options.constraint is not None or (seeded_on_host and options.seed is not None):
            return None
    np.copyto(step.num_drafts, drafts)
    return Ahead(prev, index, drafts)


def _derivable(runner: ModelRunner) -> bool:
    """Whether the kernel runs where the step does (a GPU, or Triton's interpreter) and the attention
    reads every length from the device."""
    return ((runner.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
            and runner.backend.supports_cuda_graphs)


def _places(prev_rows: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """Each row's index in prev_rows, or None when one is not there."""
    if len(rows) == len(prev_rows) and np.array_equal(rows, prev_rows):
        return np.arange(len(rows))
    order = np.argsort(prev_rows, kind="stable")
    at = np.minimum(np.searchsorted(prev_rows[order], rows), len(prev_rows) - 1)
    return order[at] if np.array_equal(prev_rows[order][at], rows) else None


def _fits(runner: ModelRunner, step: StepInput, rows: np.ndarray, ends: np.ndarray) -> bool:
    """The step checks' block and length limits at the largest ends any acceptance gives."""
    limits, b = runner.limits, runner.batch
    num_blocks = b.num_blocks[rows].copy()
    if len(step.new_block_indices):
        if step.new_block_ids.max() >= limits.num_kv_blocks:
            return False
        num_blocks[step.new_block_indices] += step.new_block_counts
    return bool(np.all(num_blocks <= limits.max_blocks_per_seq) and np.all(num_blocks * limits.block_size >= ends)
                and np.all(ends <= runner.max_model_len))


def prepare_ahead(runner: ModelRunner, rows: np.ndarray, ahead: Ahead, propose: bool) -> StepBatch:
    """The step's inputs as batch_prep would build them after the settle, every draft of the step in
    flight taken as accepted on the host and moved back by its rejections on the device."""
    b, graphs, n = runner.batch, runner.decode_graphs, len(rows)
    drafts = ahead.num_drafts
    sizes = drafts + 1
    start = b.num_computed[rows]                # every draft of the step in flight accepted
    seq_lens = start + sizes
    query_start = np.zeros(n + 1, np.int64)
    np.cumsum(sizes, out=query_start[1:])
    num_tokens = int(query_start[-1])
    layout = VerifyLayout.build(drafts, None)   # its drafts are on the device
    token_rows = rows[layout.owner]
    positions = start[layout.owner] + layout.offset
    max_seq_len = int(seq_lens.max())
    width = -(-max_seq_len // runner.block_size)
    tables = b.block_tables[token_rows, :width].reshape(-1)
    prev = ahead.prev
    rejectable = prev.layout.num_drafts[ahead.index] if prev.layout is not None else np.zeros(n, np.int64)
    parts = [rows, layout.first, layout.num_drafts, layout.owner, layout.offset, layout.next_drafts, token_rows]
    plan = None
    if propose:
        plan = runner.drafter.plan(b, rows, seq_lens, query_start, np.ones(n, bool), drafts)
        parts += plan.parts
    else:
        b.drafter_behind[rows] = True   # the drafter misses this step: no drafts for these rows again
    parts += [ahead.index, rejectable]
    unknown = np.zeros(num_tokens, np.int64)   # written by the kernel
    staged = graphs is not None and graphs.staged and num_tokens <= graphs.batch_sizes[-1]
    if staged:   # the graph's first kernel unpacks what the derivation leaves in its columns
        inputs = [runner._decode_layout.header(num_tokens, width), unknown, positions, unknown, unknown, token_rows,
                  tables]
        views = runner._staging.fill(inputs + parts, runner._decode_layout.offsets(num_tokens, width)[:-1])
        ids_d, positions_d, slots_d, seq_lens_d, tables_d = (views[i] for i in (1, 2, 3, 4, 6))
    else:
        steps = np.arange(num_tokens + 1)
        inputs = [unknown, positions, unknown, steps, unknown, steps[:-1], tables]
        views = runner._staging.fill(inputs + parts)
        ids_d, positions_d, slots_d, query_start_d, seq_lens_d, logits_d, tables_d = views[:len(inputs)]
    views = views[len(inputs):]
    sampling_d, verify, verify_rows = views[0], DeviceLayout(*views[1:6], layout.max_drafts), views[6]
    draft_plan = plan.on_device(views[7:11]) if plan is not None else None
    index_d, rejectable_d = views[-2:]
    derive(ids_d, positions_d, slots_d, seq_lens_d, tables_d, width, runner.block_size, verify, verify_rows,
           index_d, rejectable_d, prev.device_accepted, prev.device_drafts, runner.last_sampled,
           draft_plan.base_positions if draft_plan is not None else None)
    if staged:
        ids_d, positions_d = graphs.input_ids[:num_tokens], graphs.positions[:num_tokens]
        logits_d = runner._row_index[:num_tokens]
        meta = graphs.staged_meta(positions + 1, max_seq_len)
    else:
        meta = AttentionMetadata(
            slot_mapping=slots_d, query_start_loc=query_start_d.to(torch.int32), seq_lens=seq_lens_d.to(torch.int32),
            block_tables=tables_d.view(num_tokens, width).to(torch.int32), max_query_len=1, max_seq_len=max_seq_len,
            query_lens_cpu=[1] * num_tokens, seq_lens_cpu=(positions + 1).tolist())
    spec = spec_step(b, rows, layout, propose)
    spec.advance = sizes   # the counts move once the step in flight is settled
    return StepBatch(ids_d, positions_d, meta, logits_d, rows, sampling_d, token_rows, [], verify=verify,
                     verify_rows=verify_rows, spec=spec, draft_plan=draft_plan, graph=staged, ahead=True)


def warm_up_derive(runner: ModelRunner) -> None:
    """Compiles the derivation kernel (with and without a drafting plan) at start-up, over dummy
    int64 tensors like the step's (a first use mid-serving would stall the batch ~1 s: PERF_NOTES
    v27). Nothing where the step never takes this path."""
    if runner.drafter is None or not _derivable(runner):
        return
    device = runner.device
    ones = torch.ones(2, dtype=torch.int64, device=device)
    zeros = torch.zeros(2, dtype=torch.int64, device=device)
    layout = DeviceLayout(zeros, ones, zeros, zeros, zeros.clone(), 1)
    drafts = torch.zeros(2, 2, dtype=torch.int64, device=device)
    for base in (None, zeros.clone()):
        derive(zeros.clone(), ones.clone(), zeros.clone(), zeros.clone(), zeros.clone(), 1, runner.block_size, layout,
               zeros, zeros, ones, ones, drafts, runner.last_sampled, base)


def derive(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
           tables: torch.Tensor, width: int, block_size: int, verify: DeviceLayout, token_rows: torch.Tensor,
           index: torch.Tensor, rejectable: torch.Tensor, accepted: torch.Tensor | None,
           drafts: torch.Tensor | None, last_sampled: torch.Tensor, base: torch.Tensor | None) -> None:
    """Per token of the step (one launch): its position moved back by the drafts its row's step
    before rejected (`positions` holds them as if all were accepted), its length and slot, its input
    (offset 0: the row's last sampled token; j: the j-th draft made after it), and the draft after
    it to verify; per row, the drafting plan's start (`base`, when the step drafts)."""
    n = len(positions)
    if n == 0:
        return
    _derive_kernel[(n,)](
        ids, positions, slots, seq_lens, tables, width, block_size, verify.owner, verify.offset, verify.num_drafts,
        verify.next_drafts, token_rows, index, rejectable, positions if accepted is None else accepted,
        positions if drafts is None else drafts, drafts.stride(0) if drafts is not None else 0,
        drafts.stride(1) if drafts is not None else 0, last_sampled, positions if base is None else base,
        HAS_BASE=base is not None, num_warps=1)


# Nothing that varies with the step is specialised, or Triton would compile a variant per class of it
# mid-serving (PERF_NOTES v27): the integers' "equals 1" / "multiple of 16", and the pointers' 16-byte
# alignment (most are views into the staging buffer at offsets that move with the step's sizes).
_POINTERS = ["ids_ptr", "positions_ptr", "slots_ptr", "seq_lens_ptr", "tables_ptr", "owner_ptr", "offset_ptr",
             "num_drafts_ptr", "next_drafts_ptr", "token_rows_ptr", "index_ptr", "rejectable_ptr", "accepted_ptr",
             "drafts_ptr", "last_sampled_ptr", "base_ptr"]


@triton.jit(do_not_specialize=["width", "block_size", "drafts_stride", "draft_stride"],
            do_not_specialize_on_alignment=_POINTERS)
def _derive_kernel(ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr, tables_ptr, width, block_size, owner_ptr,
                   offset_ptr, num_drafts_ptr, next_drafts_ptr, token_rows_ptr, index_ptr, rejectable_ptr,
                   accepted_ptr, drafts_ptr, drafts_stride, draft_stride, last_sampled_ptr, base_ptr,
                   HAS_BASE: tl.constexpr):
    t = tl.program_id(0)
    r = tl.load(owner_ptr + t)
    j = tl.load(offset_ptr + t)
    p = tl.load(index_ptr + r)
    rejectable = tl.load(rejectable_ptr + r)
    accepted = tl.load(accepted_ptr + p, mask=rejectable > 0, other=0)
    position = tl.load(positions_ptr + t) - (rejectable - accepted)
    tl.store(positions_ptr + t, position)
    tl.store(seq_lens_ptr + t, position + 1)
    block = tl.load(tables_ptr + t * width + position // block_size)
    tl.store(slots_ptr + t, block * block_size + position % block_size)
    row_drafts = drafts_ptr + p * drafts_stride
    newest = tl.load(last_sampled_ptr + tl.load(token_rows_ptr + t), mask=j == 0, other=0)
    draft = tl.load(row_drafts + (j - 1) * draft_stride, mask=j > 0, other=0).to(tl.int64)
    tl.store(ids_ptr + t, tl.where(j == 0, newest, draft))
    following = tl.load(row_drafts + j * draft_stride, mask=j < tl.load(num_drafts_ptr + r), other=-1)
    tl.store(next_drafts_ptr + t, following.to(tl.int64))
    if HAS_BASE:
        tl.store(base_ptr + r, position + 1, mask=j == 0)
