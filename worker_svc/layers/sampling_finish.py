"""The device sampler's last pass, `_finish_kernel` (one program per row; the passes are described
in sampling_kernels.py): the row's token from the scan's parts (greedy and plain rows), from a
min-p row's restricted draw, from the cut over its gathered tokens (sampling_cut.py), or from the
single-program search (a row whose kept set overflows the buffer and its bracket: an unrestricted
draw, counts at it, pivot rounds to the cut and a redraw); its logprob, the row's counter, newest
token and penalty count.
"""
from __future__ import annotations

import triton
import triton.language as tl

from worker_svc.layers.sampling_cut import _combined_best, _draw_truncated
from worker_svc.layers.sampling_kernels import (
    C_INV_TEMPERATURE, C_PENALTY_ROW, C_TOP_K, C_TOP_P, F_GREEDY, F_LOGPROB, F_MIN_P, F_PENALTY, F_TOP_K,
    F_TOP_P, L_MODE, MODE_GATHER, MODE_MIN_P, P_BAD, P_BEST, P_DRAWN, P_DRAWN_TOKEN, P_RAW_SUM, P_RAW_TOP,
    P_TOKEN, P_TOP, PARTS, PLAN, ROWS_PTR, SEARCH_DEPTH, _float_at, _load_scores, _log_min_p, _row, _scan, _scores,
)


# --- the scan's result ---------------------------------------------------------------------------

@triton.jit
def _combined_scan(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS: tl.constexpr):
    """The row's scan over all its chunks: (its token, top z, bad, raw max, raw sum of exp)."""
    _, token = _combined_best(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS, P_BEST, P_TOKEN)
    c = tl.arange(0, CHUNKS)
    valid = c < num_chunks
    at = (i * num_chunks + c) * PARTS
    top = tl.max(tl.load(part_f_ptr + at + P_TOP, mask=valid, other=float("-inf")))
    bad = tl.max(tl.load(part_i_ptr + at + P_BAD, mask=valid, other=0))
    raw_tops = tl.load(part_f_ptr + at + P_RAW_TOP, mask=valid, other=float("-inf"))
    raw_top = tl.max(raw_tops)
    scale = tl.where(raw_tops > float("-inf"), tl.exp(raw_tops - raw_top), 0.0)
    raw_sum = tl.sum(tl.load(part_f_ptr + at + P_RAW_SUM, mask=valid, other=0.0) * scale)
    return token, top, bad, raw_top, raw_sum


@triton.jit
def _raw_argmax(raw_ptr, processed_ptr, vocab, G: tl.constexpr):
    _, token, _, _ = _scan(raw_ptr, processed_ptr, False, 0, vocab, 1.0, 0, 0, 0.0, 0.0, 0.0, False, False, G)
    return token


# --- the single-program search (a row whose kept set overflows the buffer) -----------------------

@triton.jit
def _count_above(raw_ptr, processed_ptr, use_processed, start, end, inv_t, pivot, top,
                 MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Over [start, end): how many tokens have z > pivot, and (MASS) the sums of exp(z - top) over
    z > pivot, z >= pivot and all tokens."""
    count = tl.zeros([BLOCK], tl.int32)
    above = tl.zeros([BLOCK], tl.float32)
    at_least = tl.zeros([BLOCK], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for base in range(start, end, BLOCK):
        tokens = base + tl.arange(0, BLOCK)
        z = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < end) * inv_t
        count += (z > pivot).to(tl.int32)
        if MASS:
            e = tl.exp(z - top)
            above += tl.where(z > pivot, e, 0.0)
            at_least += tl.where(z >= pivot, e, 0.0)
            total += e
    return tl.sum(count), tl.sum(above), tl.sum(at_least), tl.sum(total)


@triton.jit
def _mass_from(raw_ptr, processed_ptr, use_processed, vocab, inv_t, cut, top, BLOCK: tl.constexpr):
    """Sum of exp(z - top) over the tokens with z >= cut."""
    mass = tl.zeros([BLOCK], tl.float32)
    for base in range(0, vocab, BLOCK):
        tokens = base + tl.arange(0, BLOCK)
        z = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < vocab) * inv_t
        mass += tl.where(z >= cut, tl.exp(z - top), 0.0)
    return tl.sum(mass)


@triton.jit
def _bands(z, lo, hi, floor_z):
    """Which tokens are kept for sure (z >= hi) and which are candidates (in (lo, hi), >= floor_z)."""
    return z >= hi, (z > lo) & (z < hi) & (z >= floor_z)


@triton.jit
def _pivot_counts(raw_ptr, processed_ptr, use_processed, vocab, inv_t, top, lo, hi, floor_z, pivots,
                  MASS: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """One pass: tokens with z >= hi (count, mass), candidates in (lo, hi) above floor_z (count),
    and per pivot the candidates above it (count, mass)."""
    n_above = tl.zeros([BLOCK], tl.int32)
    m_above = tl.zeros([BLOCK], tl.float32)
    n_between = tl.zeros([BLOCK], tl.int32)
    counts = tl.zeros([BLOCK, NUM_PIVOTS], tl.int32)
    masses = tl.zeros([BLOCK, NUM_PIVOTS], tl.float32)
    for base in range(0, vocab, BLOCK):
        tokens = base + tl.arange(0, BLOCK)
        z = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < vocab) * inv_t
        above, between = _bands(z, lo, hi, floor_z)
        n_above += above.to(tl.int32)
        n_between += between.to(tl.int32)
        beats = between[:, None] & (z[:, None] > pivots[None, :])
        counts += beats.to(tl.int32)
        if MASS:
            e = tl.exp(z - top)
            m_above += tl.where(above, e, 0.0)
            masses += tl.where(beats, e[:, None], 0.0)
    return tl.sum(n_above), tl.sum(m_above), tl.sum(n_between), tl.sum(counts, axis=0), tl.sum(masses, axis=0)


@triton.jit
def _resolve(raw_ptr, processed_ptr, use_processed, vocab, inv_t, top, lo, hi, floor_z, k, mass_limit, gather_ptr,
             MASS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """The exact cut once at most CAP candidates lie in (lo, hi): gathers them, sorts them, and
    returns the lowest whose predecessors (with the tokens >= hi) stay under k and mass_limit."""
    n_above = tl.zeros([BLOCK], tl.int32)
    m_above = tl.zeros([BLOCK], tl.float32)
    written = 0
    for base in range(0, vocab, BLOCK):
        tokens = base + tl.arange(0, BLOCK)
        z = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < vocab) * inv_t
        above, between = _bands(z, lo, hi, floor_z)
        n_above += above.to(tl.int32)
        if MASS:
            m_above += tl.where(above, tl.exp(z - top), 0.0)
        position = written + tl.cumsum(between.to(tl.int32), 0) - 1
        tl.store(gather_ptr + position, z, mask=between & (position < CAP))
        written += tl.sum(between.to(tl.int32))
    tl.debug_barrier()   # the gathered values were stored by other threads of this program
    i = tl.arange(0, CAP)
    valid = i < written
    values = tl.sort(tl.load(gather_ptr + i, mask=valid, other=float("-inf")), descending=True)
    keep = valid & (tl.sum(n_above) + i < k)
    if MASS:
        e = tl.where(valid, tl.exp(values - top), 0.0)
        keep = keep & (tl.sum(m_above) + tl.cumsum(e, 0) - e < mass_limit)
    last = tl.max(tl.where(keep, i, -1))
    return tl.where(last >= 0, tl.max(tl.where(i == last, values, float("-inf"))), hi)


@triton.jit
def _find_cut(raw_ptr, processed_ptr, use_processed, vocab, inv_t, top, lo, hi, floor_z, k, mass_limit, gather_ptr,
              MASS: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr,
              MAX_ROUNDS: tl.constexpr):
    """The lowest z among tokens >= floor_z that is kept, where a value v is kept when fewer than k
    tokens have z > v and (MASS) their mass exp(z - top) sums under mass_limit. Given: hi is kept;
    nothing <= lo is. Each round counts NUM_PIVOTS evenly spaced pivots in (lo, hi) in one pass and
    narrows to the pair around the change; once at most CAP candidates remain, _resolve ends it."""
    steps = (tl.arange(0, NUM_PIVOTS) + 1).to(tl.float32) / (NUM_PIVOTS + 1)
    index = tl.arange(0, NUM_PIVOTS)
    cut = hi
    done = 0
    rounds = 0
    while (done == 0) & (rounds < MAX_ROUNDS):
        low = tl.maximum(lo, floor_z)
        pivots = low + (hi - low) * steps
        n_above, m_above, n_between, counts, masses = _pivot_counts(
            raw_ptr, processed_ptr, use_processed, vocab, inv_t, top, lo, hi, floor_z, pivots, MASS, BLOCK, NUM_PIVOTS)
        keep = n_above + counts < k
        if MASS:
            keep = keep & (m_above + masses < mass_limit)
        num_failed = tl.sum((keep == 0).to(tl.int32))   # kept is monotone: the failures come first
        count_lo = tl.where(num_failed > 0, tl.sum(tl.where(index == num_failed - 1, counts, 0)), n_between)
        count_hi = tl.where(num_failed < NUM_PIVOTS, tl.sum(tl.where(index == num_failed, counts, 0)), 0)
        lo = tl.where(num_failed > 0, tl.max(tl.where(keep, float("-inf"), pivots)), lo)
        hi = tl.where(num_failed < NUM_PIVOTS, tl.min(tl.where(keep, pivots, float("inf"))), hi)
        left = tl.where(hi <= floor_z, 0, count_lo - count_hi)   # an upper bound: ties at hi count
        if left == 0:
            cut = hi
            done = 1
        elif left <= CAP:
            cut = _resolve(raw_ptr, processed_ptr, use_processed, vocab, inv_t, top, lo, hi, floor_z, k, mass_limit,
                           gather_ptr, MASS, BLOCK, CAP)
            done = 1
        rounds += 1
    if done == 0:
        cut = hi
    return cut


@triton.jit
def _redraw(raw_ptr, processed_ptr, use_processed, vocab, inv_t, key, counter, flags, top_k, top_p, log_min_p,
            drawn, top, beaten, above, at_least, total, gather_ptr,
            G: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr,
            MAX_ROUNDS: tl.constexpr):
    """The row's token given its unrestricted draw: the draw itself when it is in the kept set,
    else the Gumbel-max over the kept set (same noise) after the search for its threshold.
    beaten/above/at_least/total: _count_above at the draw (read only when it passed min-p)."""
    has_k = (flags & F_TOP_K) != 0
    has_p = (flags & F_TOP_P) != 0
    has_min_p = (flags & F_MIN_P) != 0
    z_drawn = _load_scores(raw_ptr, processed_ptr, use_processed, drawn, True) * inv_t
    counted = (z_drawn - top >= log_min_p) | (has_min_p == 0)
    in_k = (has_k == 0) | (beaten < top_k)
    # top-p over the top-k set: its mass is at least at_least (the draw is in it), at most total.
    in_p = (has_p == 0) | (above < top_p * tl.where(has_k, at_least, total))
    out_p = has_p & (above >= top_p * total)
    token = drawn
    if (counted & in_k & in_p) == 0:
        floor_z = top - SEARCH_DEPTH
        cut = floor_z
        cut_k = floor_z
        if has_k:
            lo = tl.where(counted & (in_k == 0), z_drawn, float("-inf"))
            hi = tl.where(counted & in_k, z_drawn, top)
            cut_k = _find_cut(raw_ptr, processed_ptr, use_processed, vocab, inv_t, top, lo, hi, floor_z, top_k, 0.0,
                              gather_ptr, False, BLOCK, NUM_PIVOTS, CAP, MAX_ROUNDS)
            cut = tl.maximum(cut, cut_k)
        if has_p:
            mass_k = _mass_from(raw_ptr, processed_ptr, use_processed, vocab, inv_t,
                                tl.where(has_k, cut_k, float("-inf")), top, BLOCK)
            lo = tl.where(counted & out_p, z_drawn, float("-inf"))
            cut_p = _find_cut(raw_ptr, processed_ptr, use_processed, vocab, inv_t, top, lo, top, cut, vocab + 1,
                              top_p * mass_k, gather_ptr, True, BLOCK, NUM_PIVOTS, CAP, MAX_ROUNDS)
            cut = tl.maximum(cut, cut_p)
        if (has_k | has_p) == 0:
            cut = float("-inf")
        _, token, _, _ = _scan(raw_ptr, processed_ptr, use_processed, 0, vocab, inv_t, key, counter, cut, top,
                               tl.where(has_min_p, log_min_p, float("-inf")), True, True, G)
    return token


@triton.jit
def _draw_alone(raw_ptr, processed_ptr, use_processed, vocab, inv_t, key, counter, flags, top_k, top_p, log_min_p,
                gather_ptr, G: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr,
                MAX_ROUNDS: tl.constexpr):
    """A drawing row's token by one program's passes over the whole row: the unrestricted draw,
    the counts at it, and when it is not kept the search for the cut and the redraw."""
    _, drawn, top, bad = _scan(raw_ptr, processed_ptr, use_processed, 0, vocab, inv_t, key, counter,
                               0.0, 0.0, 0.0, True, False, G)
    if (bad != 0) | (top == float("-inf")):
        token = _raw_argmax(raw_ptr, processed_ptr, vocab, G)
    else:
        z_drawn = _load_scores(raw_ptr, processed_ptr, use_processed, drawn, True) * inv_t
        beaten, above, at_least, total = _count_above(raw_ptr, processed_ptr, use_processed, 0, vocab, inv_t,
                                                      z_drawn, top, True, BLOCK)
        token = _redraw(raw_ptr, processed_ptr, use_processed, vocab, inv_t, key, counter, flags, top_k, top_p,
                        log_min_p, drawn, top, beaten, above, at_least, total, gather_ptr,
                        G, BLOCK, NUM_PIVOTS, CAP, MAX_ROUNDS)
    return token


# --- the kernel ----------------------------------------------------------------------------------

@triton.jit(do_not_specialize_on_alignment=ROWS_PTR)
def _finish_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, keys_ptr, counters_ptr,
                   counts_ptr, part_f_ptr, part_i_ptr, plan_f_ptr, plan_i_ptr, pivot_n_ptr, pivot_m_ptr, values_ptr,
                   ids_ptr, tokens_ptr, logprobs_ptr, last_sampled_ptr, cuts_ptr, vocab, num_chunks,
                   CHUNKS: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, BRACKET_PIVOTS: tl.constexpr,
                   NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr, MID: tl.constexpr,
                   MAX_ROUNDS: tl.constexpr):
    i = tl.program_id(0)
    row, entry, flags = _row(rows_ptr, table_ptr, i)
    raw, processed, use_processed = _scores(logits_ptr, stride_logits, processed_ptr, entry, flags, i, vocab)
    inv_t = _float_at(entry, C_INV_TEMPERATURE)
    key = tl.load(keys_ptr + row)
    counter = tl.load(counters_ptr + row)
    top_k = tl.load(entry + C_TOP_K)
    top_p = _float_at(entry, C_TOP_P)
    log_min_p = _log_min_p(entry, flags)
    values = values_ptr + i.to(tl.int64) * CAP
    ids = ids_ptr + i.to(tl.int64) * CAP
    token, top, bad, raw_top, raw_sum = _combined_scan(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS)
    mode = tl.load(plan_i_ptr + i * PLAN + L_MODE)
    unusable = (bad != 0) | (top == float("-inf"))
    cut = float("-inf")
    alone = 0                     # 1: the single-program search, over the processed scores; 2: the raw logits
    if (flags & F_GREEDY) != 0:
        if use_processed & unusable:   # the penalties broke the scores: the raw logits decide
            token = _raw_argmax(raw, processed, vocab, G)
    elif unusable:
        # Scores the penalties broke (NaN, +inf, nothing finite) are dropped for the raw logits;
        # a temperature that overflowed usable scores leaves the raw argmax.
        scores_best = top
        scores_bad = bad
        if use_processed:
            scores_best, _, _, scores_bad = _scan(raw, processed, True, 0, vocab, inv_t, key, counter,
                                                  0.0, 0.0, 0.0, False, False, G)
        if use_processed & ((scores_bad != 0) | (scores_best == float("-inf"))):
            alone = 2
        else:
            token = _raw_argmax(raw, processed, vocab, G)
    elif mode == MODE_MIN_P:
        _, token = _combined_best(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS, P_DRAWN, P_DRAWN_TOKEN)
    elif mode == MODE_GATHER:
        token, cut, alone = _draw_truncated(part_f_ptr, part_i_ptr, plan_f_ptr, plan_i_ptr, pivot_n_ptr, pivot_m_ptr,
                                            values, ids, i, num_chunks, flags, top_k, top_p, log_min_p, key, counter,
                                            top, CHUNKS, CAP, SMALL, MID, BRACKET_PIVOTS)
    if alone != 0:
        token = _draw_alone(raw, processed, use_processed & (alone == 1), vocab, inv_t, key, counter, flags, top_k,
                            top_p, log_min_p, values, G, BLOCK, NUM_PIVOTS, CAP, MAX_ROUNDS)
        cut = float("nan")
    tl.store(tokens_ptr + i, token.to(tl.int64))
    tl.store(cuts_ptr + i, cut)
    if (flags & F_LOGPROB) != 0:
        tl.store(logprobs_ptr + i, tl.load(raw + token).to(tl.float32) - raw_top - tl.log(raw_sum))
    else:
        tl.store(logprobs_ptr + i, 0.0)
    tl.store(last_sampled_ptr + row, token.to(tl.int64))
    tl.store(counters_ptr + row, counter + 1)
    if (flags & F_PENALTY) != 0:
        at = counts_ptr + tl.load(entry + C_PENALTY_ROW).to(tl.int64) * vocab + token
        tl.store(at, tl.load(at) + 1)
