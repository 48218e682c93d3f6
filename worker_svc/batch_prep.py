"""A step's batch preparation: the flat inputs of the step's rows and scheduled tokens, built with
vectorised host work over rows and tokens (never over a request's whole context) and sent to the
device in one copy (staging.py). A pure-decode step the decode graphs can take is staged where
they read it, and so is a verifying step whose tokens are laid out as decode rows; a step that
verifies drafts carries its verification layout (spec_decode/).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from worker_svc.input_batch import InputBatch
from worker_svc.layers.attention import AttentionMetadata
from worker_svc.prompt_scoring import plan_prompt_scoring
from worker_svc.spec_decode.bookkeeping import SpecStep
from worker_svc.spec_decode.verification import DeviceLayout, VerifyLayout
from worker_svc.staging import EMPTY_PART
from worker_svc.step_batch import StepBatch

if TYPE_CHECKING:
    from worker_svc.model_runner import ModelRunner


def prepare_batch(runner: ModelRunner, rows: np.ndarray, counts: np.ndarray, drafts: np.ndarray | None = None,
                  propose: bool = False) -> StepBatch:
    """The step's flat inputs, vectorised over rows and scheduled tokens (never over a
    request's whole context), in one host-to-device copy. Advances the rows' counts: the
    computed tokens, and the token each sampling row is about to get. `drafts`: per row, the
    drafts it verifies after its scheduled tokens (their values are on the host)."""
    b, bs = runner.batch, runner.block_size
    graphs = runner.decode_graphs
    if (drafts is None and runner.drafter is None and runner.bookkeeping is None and not b.num_scoring
            and graphs is not None and graphs.staged and 0 < len(rows) <= graphs.batch_sizes[-1]
            and int(counts.sum()) == len(rows)):   # (each count is at least 1)
        staged = _stage_plain_decode(runner, rows)
        if staged is not None:
            return staged
    start = b.num_computed[rows]
    known_end = start + counts
    sizes = counts if drafts is None else counts + drafts
    seq_lens = start + sizes
    query_start = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(sizes, out=query_start[1:])
    num_tokens = int(query_start[-1])
    positions = np.arange(num_tokens) + np.repeat(start - query_start[:-1], sizes)
    token_rows = np.repeat(rows, sizes)
    # A position the host knows reads its token here; the one past them (a decode of the
    # newest sampled token) is gathered on the device from the row's last sample.
    on_host = positions < b.num_host_tokens[token_rows]
    input_ids = np.where(on_host, b.token_ids[token_rows, np.minimum(positions, runner.max_model_len - 1)], 0)
    if drafts is not None:               # drafts follow the known tokens
        draft_at = positions - np.repeat(known_end, sizes)
        is_draft = draft_at >= 0
        width = b.draft_tokens.shape[1]
        input_ids = np.where(is_draft, b.draft_tokens[token_rows, np.clip(draft_at, 0, width - 1)], input_ids)
        on_host |= is_draft
    gather_at = np.flatnonzero(~on_host)
    gather_rows = token_rows[gather_at]
    slot_mapping = b.block_tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
    max_seq_len = int(seq_lens.max())
    width = -(-max_seq_len // bs)
    block_tables = b.block_tables[rows, :width]
    samples = known_end == b.num_tokens[rows]     # a chunk ending mid-prompt samples nothing
    sampling_rows = rows[samples]
    layout = None
    if drafts is not None:               # every position of a verified run samples
        layout = VerifyLayout.build(drafts[samples], b.draft_tokens[sampling_rows])
        position_rows = sampling_rows[layout.owner]
        offsets = layout.offset
        logits_indices = query_start[1:][samples][layout.owner] - 1 - layout.num_drafts[layout.owner] + offsets
    else:
        position_rows, offsets = sampling_rows, None
        logits_indices = query_start[1:][samples] - 1
    constrained = top_ks = next_drafts = None
    constrained_at = top_at = EMPTY_PART
    if runner.sampler is not None or runner.device_sampler is not None:
        constrained_at, constrained, next_drafts = _constrained(b, position_rows, layout)
        top_at, top_ks = _top_logprobs(b, position_rows)
    # The torch sampler draws a seeded position by its output index; the device sampler keeps its own.
    seeded = _seeded_output_indices(runner, position_rows, offsets) if runner.sampler is not None else []
    score_at, score_targets, scored = (plan_prompt_scoring(b, rows, start, seq_lens, query_start)
                                       if b.num_scoring else (EMPTY_PART, EMPTY_PART, None))
    # A decode-shaped step whose every row samples is staged where the decode graphs read it: no
    # kernel runs on the device before their replay.
    as_decodes = layout is not None and verifies_as_decodes(runner, counts, num_tokens)
    staged = (graphs is not None and graphs.staged and (num_tokens == len(rows) or as_decodes)
              and num_tokens <= graphs.batch_sizes[-1] and samples.all() and not scored)
    if staged and runner.bookkeeping is None:   # a plain decode step: its sampling replays a graph too
        ids = np.where(on_host, input_ids, -1)
        b.num_computed[rows] = seq_lens
        b.num_tokens[sampling_rows] += 1
        return _stage_decode(runner, ids, positions, slot_mapping, seq_lens, rows, block_tables, constrained_at,
                             constrained, top_at, top_ks)
    attn_query_start, attn_seq_lens, attn_tables, attn_sizes = query_start, seq_lens, block_tables, sizes
    if as_decodes:
        # Each token of a verified run attends as a decode row over its own prefix (the store
        # writes every token's KV before the attention reads): the decode graphs' shape.
        attn_sizes = np.ones(num_tokens, np.int64)
        attn_query_start, attn_seq_lens = np.arange(num_tokens + 1), positions + 1
        attn_tables = b.block_tables[token_rows, :width]
    # After the forward's inputs, what the sampling, the verification and the proposer read.
    parts = [sampling_rows]
    if layout is not None:
        parts += [layout.first, layout.num_drafts, layout.owner, layout.offset, layout.next_drafts, position_rows]
    # A proposer on the device runs only in steps that ask for drafts (at most the scheduler's
    # batch threshold): past it, a step costs what it costs without speculation. Its plan
    # travels in the step's copy.
    plan = None
    if runner.drafter is not None:
        if propose:
            plan = runner.drafter.plan(b, rows, seq_lens, query_start, samples,
                                       layout.num_drafts if layout is not None else None)
            parts += plan.parts
        else:
            b.drafter_behind[rows] = True   # the drafter misses this step: no drafts for these rows again
    # What only some requests ask for travels only when asked (a plain step copies nothing more).
    extras = (constrained_at, top_at, score_at, score_targets)
    asked = any(len(part) for part in extras)
    if asked:
        parts += extras
    if staged:   # a speculating worker's: the graph's first kernel unpacks its inputs
        inputs = [runner._decode_layout.header(num_tokens, width), np.where(on_host, input_ids, -1), positions,
                  slot_mapping, attn_seq_lens, token_rows, attn_tables.reshape(-1)]
        views = runner._staging.fill(inputs + parts, runner._decode_layout.offsets(num_tokens, width)[:-1],
                                     first_view=len(inputs))
        ids_d, positions_d = graphs.input_ids[:num_tokens], graphs.positions[:num_tokens]
        logits_d = runner._row_index[:num_tokens]
        meta = graphs.staged_meta(attn_seq_lens, max_seq_len)
    else:
        inputs = [input_ids, positions, slot_mapping, attn_query_start, attn_seq_lens, logits_indices, gather_at,
                  gather_rows, attn_tables.reshape(-1)]
        views = runner._staging.fill(inputs + parts)
        ids_d, positions_d, slots_d, query_start_d, seq_lens_d, logits_d, gather_at_d, gather_rows_d, tables_d = \
            views[:len(inputs)]
        views = views[len(inputs):]
        if len(gather_at):
            ids_d.index_copy_(0, gather_at_d, runner.last_sampled.index_select(0, gather_rows_d))
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            query_start_loc=query_start_d.to(torch.int32),
            seq_lens=seq_lens_d.to(torch.int32),
            block_tables=tables_d.view(len(attn_sizes), width).to(torch.int32),
            max_query_len=int(attn_sizes.max()),
            max_seq_len=max_seq_len,
            query_lens_cpu=attn_sizes.tolist(),
            seq_lens_cpu=attn_seq_lens.tolist(),
        )
    sampling_d, views = views[0], views[1:]
    verify = verify_rows = None
    if layout is not None:
        verify, verify_rows = DeviceLayout(*views[:5], layout.max_drafts), views[5]
        views = views[6:]
    draft_plan = None
    if plan is not None:
        draft_plan, views = plan.on_device(views[:4]), views[4:]
    constrained_d, top_d, score_at_d, score_targets_d = views if asked else (None,) * 4
    spec = spec_step(b, sampling_rows, layout, propose) if runner.bookkeeping is not None else None
    b.num_computed[rows] = seq_lens
    b.num_tokens[sampling_rows] += 1
    return StepBatch(ids_d, positions_d, meta, logits_d, sampling_rows, sampling_d, position_rows, seeded,
                     constrained=(constrained_at.tolist(), constrained, constrained_d) if constrained else None,
                     constrained_next_drafts=next_drafts,
                     top_ks=top_ks, top_positions=top_d if top_ks is not None else None,
                     score_indices=score_at_d if scored else None,
                     score_targets=score_targets_d if scored else None, scored=scored or None,
                     verify=verify, verify_rows=verify_rows, spec=spec, draft_plan=draft_plan, graph=staged)


def _stage_plain_decode(runner: ModelRunner, rows: np.ndarray) -> StepBatch | None:
    """prepare_batch for the most common step: one token a row, each row's next (its newest sampled token, or
    a known one), no drafts, nothing scored, staged for the decode graphs; with a third of the general path's
    numpy calls, which at a few rows are its cost. None when a row is not at its next token (a prompt's chunk
    that samples nothing): the general path takes that step."""
    b, bs = runner.batch, runner.block_size
    positions = b.num_computed[rows]
    seq_lens = positions + 1
    if not (seq_lens == b.num_tokens[rows]).all():
        return None
    on_host = positions < b.num_host_tokens[rows]
    ids = (np.where(on_host, b.token_ids[rows, np.minimum(positions, runner.max_model_len - 1)], -1)
           if on_host.any() else np.full(len(rows), -1, np.int64))
    slot_mapping = b.block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
    block_tables = b.block_tables[rows, :-(-int(seq_lens.max()) // bs)]
    constrained = top_ks = None
    constrained_at = top_at = EMPTY_PART
    if runner.sampler is not None or runner.device_sampler is not None:
        constrained_at, constrained, _ = _constrained(b, rows, None)
        top_at, top_ks = _top_logprobs(b, rows)
    b.num_computed[rows] = seq_lens
    b.num_tokens[rows] += 1
    return _stage_decode(runner, ids, positions, slot_mapping, seq_lens, rows, block_tables, constrained_at,
                         constrained, top_at, top_ks)


def verifies_as_decodes(runner: ModelRunner, counts: np.ndarray, num_tokens: int) -> bool:
    """A step of decodes and their drafts only, which the decode graphs can take as decode rows."""
    graphs = runner.decode_graphs
    return (runner.verify_as_decodes and bool((counts == 1).all())
            and (graphs is None or (graphs.usable and num_tokens <= graphs.batch_sizes[-1])))


def _seeded_output_indices(runner: ModelRunner, position_rows: np.ndarray, offsets: np.ndarray | None) -> list[int]:
    """The output index each seeded sampled position draws (offsets: its place in a verified run)."""
    b = runner.batch
    meta = runner._sampling_metadata(position_rows)
    if not meta.seeded:
        return []
    output_index = b.num_tokens[position_rows] - b.num_prompt[position_rows]
    if offsets is not None:
        output_index = output_index + offsets
    return [int(output_index[meta.drawing[j]]) for j, _ in meta.seeded]


def _constrained(b: InputBatch, position_rows: np.ndarray, layout: VerifyLayout | None):
    """(sampled positions with a grammar, their matchers or None, the draft after each or None)."""
    if not b.num_constrained:
        return EMPTY_PART, None, None
    at = np.flatnonzero(b.constrained[position_rows])
    if not len(at):
        return at, None, None
    matchers = [b.matchers[r] for r in position_rows[at].tolist()]
    return at, matchers, layout.next_drafts[at].tolist() if layout is not None else None


def _top_logprobs(b: InputBatch, position_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(sampled positions that asked for top logprobs, each sampled position's k or None)."""
    if not b.num_top_logprobs:
        return EMPTY_PART, None
    top_ks = b.top_logprobs[position_rows]
    top_at = np.flatnonzero(top_ks)
    return top_at, top_ks if len(top_at) else None


def spec_step(b: InputBatch, sampling_rows: np.ndarray, layout: VerifyLayout | None, propose: bool) -> SpecStep:
    """The bookkeeping record of a step (before its counts advance)."""
    proposable = (np.array([b.options[r].speculative for r in sampling_rows.tolist()], dtype=bool)
                  & ~b.drafter_behind[sampling_rows] if propose else np.zeros(len(sampling_rows), dtype=bool))
    return SpecStep(sampling_rows, b.generation[sampling_rows], b.num_tokens[sampling_rows], layout, propose,
                    proposable)


def _stage_decode(runner: ModelRunner, ids, positions, slot_mapping, seq_lens, rows, block_tables, constrained_at,
                  constrained, top_at, top_ks) -> StepBatch:
    """A pure-decode step whose every row samples, staged where the decode graphs read it
    (graph_inputs.py): one host-to-device copy, and no work on the device before the replay."""
    n, width = block_tables.shape
    parts = [runner._decode_layout.header(n, width), ids, positions, slot_mapping, seq_lens, rows,
             block_tables.reshape(-1)]
    extras = [part for part in (constrained_at, top_at) if len(part)]
    extra_views = iter(runner._staging.fill(parts + extras, runner._decode_layout.offsets(n, width)[:-1],
                                            first_view=len(parts)))
    constrained_d = next(extra_views) if len(constrained_at) else None
    top_d = next(extra_views) if top_ks is not None else None
    return StepBatch(None, None, None, None, rows, runner.decode_graphs.rows[:n], rows, [],
                     constrained=(constrained_at.tolist(), constrained, constrained_d) if constrained else None,
                     top_ks=top_ks, top_positions=top_d, graph=True)
