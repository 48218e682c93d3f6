"""The top-k / top-p / min-p cut of the device sampler (its passes are described in
sampling_kernels.py): the plan's bound below which no token is kept (from the scan's group maxima
and masses), the gather of the tokens above it, the pivots and the bracket of a row whose gathered
set overflows the buffer, the restricted draws of min-p rows and of the tokens above a bracket, and
the exact cut and draw over the gathered tokens that the finish kernel (sampling_finish.py) takes.
Kernels: `_plan_kernel`, `_gather_kernel`, `_pivot_kernel`, `_bracket_kernel`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from worker_svc.layers.sampling_kernels import (
    C_INV_TEMPERATURE, C_LOG_MIN_P, C_TOP_K, C_TOP_P, F_GREEDY, F_MIN_P, F_TOP_K, F_TOP_P, L_BRACKETED,
    L_GATHERED, L_LIMIT, L_LO, L_MODE, L_TOP, MODE_GATHER, MODE_MIN_P, MODE_NONE, NO_TOKEN, P_BAD, P_DRAWN,
    P_DRAWN_TOKEN, P_MASS, P_TOP, PARTS, PLAN, ROWS_PTR, SEARCH_DEPTH, _float_at, _gumbel, _gumbel_at, _load_scores,
    _log_min_p, _row, _scores,
)

MASS_MARGIN = tl.constexpr(1e-3)    # the top-p bound's slack over float32 rounding of mass sums
MIN_P_SLACK = tl.constexpr(1e-5)    # a gather's min-p bound sits this far (relative) below the exact test


# --- a truncating row's cut from its gathered tokens ---------------------------------------------

@triton.jit
def _restricted_best(raw_ptr, processed_ptr, use_processed, start, end, inv_t, key, counter, cut, top, log_min_p,
                     G: tl.constexpr):
    """Over tokens [start, end) with z >= cut and z - top >= log_min_p: the best z + noise and its
    first token (-inf when none). Tiles without such a token compute no noise."""
    g = tl.arange(0, G)[:, None]
    j = tl.arange(0, 4)[None, :]
    best = tl.full([G, 4], float("-inf"), tl.float32)
    best_at = start + 4 * g + j
    for base in range(start, end, 4 * G):
        tokens = base + 4 * g + j
        z = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < end) * inv_t
        kept = (z >= cut) & (z - top >= log_min_p) & (tokens < end)
        if tl.max(kept.to(tl.int32)) > 0:
            score = tl.where(kept, z + _gumbel(key, counter, base, G), float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_at = tl.where(better, tokens, best_at)
    winner = tl.max(best)
    return winner, tl.min(tl.where(best == winner, best_at, NO_TOKEN))


@triton.jit
def _gather(raw_ptr, processed_ptr, use_processed, start, end, inv_t, lo, hi, count_ptr, values_ptr, ids_ptr,
            CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Appends the tokens of [start, end) with lo <= z < hi (z, id) to the row's buffer at places
    taken from the row's counter (the first CAP are stored; the counter counts on). Tiles of
    [BLOCK // 8, 8]: a thread holds a row of 8 (one vector load), counts it, takes its places with
    one atomic when it has a token and numbers them by itself; sm_90 code then needs no barrier
    (0.7 warp instructions a token)."""
    counter = count_ptr + tl.zeros([BLOCK // 8], tl.int32)
    for base in range(start, end, BLOCK):
        tokens = base + 8 * tl.arange(0, BLOCK // 8)[:, None] + tl.arange(0, 8)[None, :]
        z = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < end) * inv_t
        take = ((z >= lo) & (z < hi)).to(tl.int32)   # masked tokens are -inf, below lo
        mine = tl.sum(take, axis=1)
        first = tl.atomic_add(counter, mine, mask=mine > 0, sem="relaxed")   # a place, no order
        position = first[:, None] + tl.cumsum(take, 1) - take
        stored = (take != 0) & (position < CAP)
        tl.store(values_ptr + position, z, mask=stored)
        tl.store(ids_ptr + position, tokens, mask=stored)


@triton.jit
def _count_bound(maxima, k, floor_z, top, ROUNDS: tl.constexpr):
    """The highest v (to within (top - floor_z) / 2**ROUNDS) that k group maxima reach: k tokens
    have z >= v, so none below v is among the top k. floor_z when fewer than k maxima reach it."""
    lo = floor_z
    hi = top
    if tl.sum((maxima >= top).to(tl.int32)) >= k:
        lo = top
    elif tl.sum((maxima >= floor_z).to(tl.int32)) >= k:
        for _ in range(ROUNDS):
            mid = lo + (hi - lo) * 0.5
            enough = tl.sum((maxima >= mid).to(tl.int32)) >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
    return lo


@triton.jit
def _mass_bound(maxima_ptrs, mask, limit, floor_z, top, ROUNDS: tl.constexpr):
    """A v (within (top - floor_z) / 2**ROUNDS of the highest) such that groups whose maxima are v
    or more hold, in their maxima alone, mass exp(z - top) of at least limit: every token below v is
    beaten by that mass, so top-p drops it. floor_z when all the maxima above it hold less. The
    bisection keeps only the weights live (with the maxima too, the compiler recomputes the weights
    every round); the maxima are read again for v."""
    weights = tl.exp(tl.load(maxima_ptrs, mask=mask, other=float("-inf")) - top)
    lo = floor_z - top
    hi = 0.0
    bound = floor_z
    if tl.sum(tl.where(weights > tl.exp(lo), weights, 0.0)) >= limit:
        for _ in range(ROUNDS):
            mid = lo + (hi - lo) * 0.5
            enough = tl.sum(tl.where(weights > tl.exp(mid), weights, 0.0)) >= limit
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        counted = weights > tl.exp(lo)
        maxima = tl.load(maxima_ptrs, mask=mask, other=float("inf"))
        bound = tl.maximum(floor_z, tl.min(tl.where(counted, maxima, float("inf"))))
    return bound


@triton.jit
def _pivots(lo, top, P: tl.constexpr):
    """P increasing values from lo to top, closer together near lo (where the tokens are dense)."""
    index = tl.arange(0, P)
    step = index.to(tl.float32) / (P - 1)
    return tl.where(index == P - 1, top, lo + (top - lo) * step * step)


@triton.jit
def _pivot_stats(raw_ptr, processed_ptr, use_processed, start, end, inv_t, pivots, top, MASS: tl.constexpr,
                 BLOCK: tl.constexpr, P: tl.constexpr):
    """Per pivot, the tokens of [start, end) with z >= pivot: how many and (MASS) their mass exp(z - top).
    Pivots along the first axis: each thread then holds its tokens for every pivot (the other way
    round, sm_90 code computes each token's exp on several threads: 1.85x the instructions)."""
    counts = tl.zeros([P, BLOCK], tl.int32)
    masses = tl.zeros([P, BLOCK], tl.float32)
    for base in range(start, end, BLOCK):
        tokens = base + tl.arange(0, BLOCK)
        z = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < end) * inv_t
        at_least = z[None, :] >= pivots[:, None]
        counts += at_least.to(tl.int32)
        if MASS:
            masses += tl.where(at_least, tl.exp(z - top)[None, :], 0.0)
    return tl.sum(counts, axis=1), tl.sum(masses, axis=1)


@triton.jit
def _bracket(pivot_n_ptr, pivot_m_ptr, i, num_chunks, lo_g, top, k, limit, has_p, CHUNKS: tl.constexpr,
             P: tl.constexpr):
    """From the counts (and masses) of the tokens >= each pivot, lo_g the first, where the cut lies:
    (lo, hi, count and mass of the tokens >= hi, count of those in [lo, hi)). Every token >= hi is
    kept (hi: the lowest pivot whose count or mass is under the bound; +inf when none is), none
    below lo (lo: the highest pivot below hi; lo_g when hi is lo_g)."""
    c = tl.arange(0, CHUNKS)
    cells = (i * num_chunks + c[:, None]) * P + tl.arange(0, P)[None, :]
    n = tl.sum(tl.load(pivot_n_ptr + cells, mask=(c < num_chunks)[:, None], other=0), axis=0)
    m = tl.sum(tl.load(pivot_m_ptr + cells, mask=(c < num_chunks)[:, None], other=0.0), axis=0)
    pivots = _pivots(lo_g, top, P)
    index = tl.arange(0, P)
    sure = tl.where(has_p, m < limit, n < k)
    failing = tl.sum((sure == 0).to(tl.int32))   # kept is monotone: the failing pivots come first
    hi = tl.where(failing < P, tl.min(tl.where(sure, pivots, float("inf"))), float("inf"))
    n_hi = tl.sum(tl.where(index == failing, n, 0))
    m_hi = tl.sum(tl.where(index == failing, m, 0.0))
    lo = tl.where(failing > 0, tl.max(tl.where(sure, float("-inf"), pivots)), lo_g)
    n_lo = tl.sum(tl.where(index == tl.maximum(failing - 1, 0), n, 0))
    return lo, hi, n_hi, m_hi, n_lo - n_hi


@triton.jit
def _overflowed(plan_i_ptr, i, flags, CAP: tl.constexpr):
    """Whether the row gathered more than CAP tokens and can bracket its cut instead (top-k or top-p
    but not both: top-p over top-k needs the whole top-k set's mass)."""
    plan = plan_i_ptr + i * PLAN
    one_cut = ((flags & F_TOP_K) != 0) != ((flags & F_TOP_P) != 0)
    return (tl.load(plan + L_MODE) == MODE_GATHER) & (tl.load(plan + L_GATHERED) > CAP) & one_cut


@triton.jit
def _last_kept(keep, values, otherwise, SIZE: tl.constexpr):
    i = tl.arange(0, SIZE)
    last = tl.max(tl.where(keep, i, -1))
    return tl.where(last >= 0, tl.max(tl.where(i == last, values, float("-inf"))), otherwise)


@triton.jit
def _draw_gathered(values_ptr, ids_ptr, n, top, k, top_p, limit, has_k, has_p, n_above, m_above, hi, log_min_p,
                   key, counter, SIZE: tl.constexpr):
    """The Gumbel-max over the kept ones of n (<= SIZE) gathered tokens, every token that is both
    below hi and possibly kept among them; above hi, n_above tokens of mass m_above, all kept.
    Returns (its score, its token, the cut: the lowest kept value, hi when none below hi is kept).
    Top-k keeps a value fewer than k tokens beat; top-p one whose beaters' mass is under limit or,
    with top-k, under top_p times the top-k set's mass (then the tokens are the whole top-k set)."""
    i = tl.arange(0, SIZE)
    valid = i < n
    z = tl.load(values_ptr + i, mask=valid, other=float("-inf"))
    ids = tl.load(ids_ptr + i, mask=valid, other=0)
    ranked = tl.sort(z, descending=True)
    e = tl.where(valid, tl.exp(ranked - top), 0.0)
    keep = valid
    if has_k:
        keep = keep & (n_above + i < k)
    if has_p:
        if has_k:
            cut_k = _last_kept(keep, ranked, hi, SIZE)
            limit = top_p * (m_above + tl.sum(tl.where(valid & (ranked >= cut_k), e, 0.0)))
        keep = keep & (m_above + tl.cumsum(e, 0) - e < limit)
    cut = _last_kept(keep, ranked, hi, SIZE)
    kept = valid & (z >= cut) & (z - top >= log_min_p)
    score = tl.where(kept, z + _gumbel_at(key, counter, ids), float("-inf"))
    winner = tl.max(score)
    return winner, tl.min(tl.where(kept & (score == winner), ids, NO_TOKEN)), cut


@triton.jit
def _combined_best(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS: tl.constexpr, SCORE: tl.constexpr,
                   TOKEN: tl.constexpr):
    """The best of the row's chunks by their SCORE part (a draw's, or the scan's): (its score, its
    TOKEN part; the lowest such token on a tie)."""
    c = tl.arange(0, CHUNKS)
    valid = c < num_chunks
    at = (i * num_chunks + c) * PARTS
    best = tl.load(part_f_ptr + at + SCORE, mask=valid, other=float("-inf"))
    winner = tl.max(best)
    tokens = tl.load(part_i_ptr + at + TOKEN, mask=valid, other=NO_TOKEN)
    return winner, tl.min(tl.where(valid & (best == winner), tokens, NO_TOKEN))


@triton.jit
def _draw_sized(values_ptr, ids_ptr, n, top, k, top_p, limit, has_k, has_p, n_above, m_above, hi, log_min_p, key,
                counter, SMALL: tl.constexpr, MID: tl.constexpr, CAP: tl.constexpr):
    """_draw_gathered at the smallest of three sizes that holds n (sorting 4,096 costs 5x 1,024)."""
    if n <= SMALL:
        best, token, cut = _draw_gathered(values_ptr, ids_ptr, n, top, k, top_p, limit, has_k, has_p, n_above,
                                          m_above, hi, log_min_p, key, counter, SMALL)
    elif n <= MID:
        best, token, cut = _draw_gathered(values_ptr, ids_ptr, n, top, k, top_p, limit, has_k, has_p, n_above,
                                          m_above, hi, log_min_p, key, counter, MID)
    else:
        best, token, cut = _draw_gathered(values_ptr, ids_ptr, n, top, k, top_p, limit, has_k, has_p, n_above,
                                          m_above, hi, log_min_p, key, counter, CAP)
    return best, token, cut


@triton.jit
def _draw_truncated(part_f_ptr, part_i_ptr, plan_f_ptr, plan_i_ptr, pivot_n_ptr, pivot_m_ptr, values_ptr, ids_ptr,
                    i, num_chunks, flags, top_k, top_p, log_min_p, key, counter, top,
                    CHUNKS: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr, MID: tl.constexpr,
                    P: tl.constexpr):
    """A top-k/top-p row's (token, cut, alone): from its gathered tokens, or from its bracket;
    alone = 1 when neither fits the buffer (the row then takes the single-program search)."""
    has_k = (flags & F_TOP_K) != 0
    has_p = (flags & F_TOP_P) != 0
    plan_f = plan_f_ptr + i * PLAN
    plan_i = plan_i_ptr + i * PLAN
    limit = tl.load(plan_f + L_LIMIT)
    n = tl.load(plan_i + L_GATHERED)
    n_above = 0
    m_above = 0.0
    hi = top
    bracketed = 0
    alone = 0
    if n > CAP:
        if _overflowed(plan_i_ptr, i, flags, CAP):
            _, hi, n_above, m_above, candidates = _bracket(pivot_n_ptr, pivot_m_ptr, i, num_chunks,
                                                           tl.load(plan_f + L_LO), top, top_k, limit, has_p, CHUNKS, P)
            bracketed = 1
            alone = (candidates > CAP).to(tl.int32)
            n = tl.load(plan_i + L_BRACKETED)
        else:
            alone = 1
    token = NO_TOKEN
    cut = top
    if alone == 0:
        best, token, cut = _draw_sized(values_ptr, ids_ptr, n, top, top_k, top_p, limit, has_k, has_p, n_above,
                                       m_above, hi, log_min_p, key, counter, SMALL, MID, CAP)
        if bracketed != 0:   # the tokens above the bracket drew in the bracket pass
            above, above_token = _combined_best(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS, P_DRAWN,
                                                      P_DRAWN_TOKEN)
            if (above > best) | ((above == best) & (above_token < token)):
                token = above_token
    return token, cut, alone


# --- the kernels ---------------------------------------------------------------------------------

@triton.jit(do_not_specialize_on_alignment=ROWS_PTR)
def _plan_kernel(rows_ptr, table_ptr, part_f_ptr, part_i_ptr, groups_ptr, plan_f_ptr, plan_i_ptr, num_chunks,
                 CHUNKS: tl.constexpr, GROUPS: tl.constexpr, ROUNDS: tl.constexpr):
    i = tl.program_id(0)
    _, entry, flags = _row(rows_ptr, table_ptr, i)
    c = tl.arange(0, CHUNKS)
    valid = c < num_chunks
    at = (i * num_chunks + c) * PARTS
    tops = tl.load(part_f_ptr + at + P_TOP, mask=valid, other=float("-inf"))
    top = tl.max(tops)
    bad = tl.max(tl.load(part_i_ptr + at + P_BAD, mask=valid, other=0))
    truncating = ((flags & F_GREEDY) == 0) & ((flags & (F_TOP_K | F_TOP_P | F_MIN_P)) != 0)
    mode = MODE_NONE
    lo = float("-inf")
    limit = 0.0
    if truncating & (bad == 0) & (top > float("-inf")):
        has_k = (flags & F_TOP_K) != 0
        has_p = (flags & F_TOP_P) != 0
        if (has_k | has_p) == 0:
            mode = MODE_MIN_P
        else:
            mode = MODE_GATHER
            floor_z = top - SEARCH_DEPTH
            cells = groups_ptr + (i * num_chunks + c[:, None]).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)[None, :]
            if has_k:
                maxima = tl.load(cells, mask=valid[:, None], other=float("-inf"))
                lo = _count_bound(maxima, tl.load(entry + C_TOP_K), floor_z, top, ROUNDS)
            else:
                masses = tl.load(part_f_ptr + at + P_MASS, mask=valid, other=0.0)
                total = tl.sum(tl.where(tops > float("-inf"), masses * tl.exp(tops - top), 0.0))
                limit = _float_at(entry, C_TOP_P) * total
                lo = _mass_bound(cells, valid[:, None], limit * (1.0 + MASS_MARGIN), floor_z, top, ROUNDS)
            if ((flags & F_MIN_P) != 0) & ((has_k & has_p) == 0):   # top-p over top-k weighs all the top k
                log_min_p = _float_at(entry, C_LOG_MIN_P)
                lo = tl.maximum(lo, top + log_min_p - MIN_P_SLACK * (1.0 + tl.abs(top) + tl.abs(log_min_p)))
    plan_f = plan_f_ptr + i * PLAN
    plan_i = plan_i_ptr + i * PLAN
    tl.store(plan_f + L_LO, lo)
    tl.store(plan_f + L_TOP, top)
    tl.store(plan_f + L_LIMIT, limit)
    tl.store(plan_i + L_MODE, mode)
    tl.store(plan_i + L_GATHERED, 0)
    tl.store(plan_i + L_BRACKETED, 0)


@triton.jit(do_not_specialize_on_alignment=ROWS_PTR)
def _gather_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, keys_ptr, counters_ptr,
                   part_f_ptr, part_i_ptr, plan_f_ptr, plan_i_ptr, values_ptr, ids_ptr, vocab, chunk, num_chunks,
                   CAP: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, s) of a (rows, S) grid: row i's chunks s, s + S, ... G: a restricted draw's tile
    ([G, 4] tokens), small so that its noise skips more tiles."""
    i = tl.program_id(0)
    mode = tl.load(plan_i_ptr + i * PLAN + L_MODE)
    if mode != MODE_NONE:
        row, entry, flags = _row(rows_ptr, table_ptr, i)
        raw, processed, use_processed = _scores(logits_ptr, stride_logits, processed_ptr, entry, flags, i, vocab)
        inv_t = _float_at(entry, C_INV_TEMPERATURE)
        top = tl.load(plan_f_ptr + i * PLAN + L_TOP)
        if mode == MODE_GATHER:
            lo = tl.load(plan_f_ptr + i * PLAN + L_LO)
            for c in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
                start = c * chunk
                _gather(raw, processed, use_processed, start, tl.minimum(start + chunk, vocab), inv_t, lo,
                        float("inf"), plan_i_ptr + i * PLAN + L_GATHERED, values_ptr + i.to(tl.int64) * CAP,
                        ids_ptr + i.to(tl.int64) * CAP, CAP, BLOCK)
        else:
            key = tl.load(keys_ptr + row)
            counter = tl.load(counters_ptr + row)
            log_min_p = _float_at(entry, C_LOG_MIN_P)
            for c in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
                start = c * chunk
                best, at = _restricted_best(raw, processed, use_processed, start, tl.minimum(start + chunk, vocab),
                                            inv_t, key, counter, float("-inf"), top, log_min_p, G)
                out = (i * num_chunks + c) * PARTS
                tl.store(part_f_ptr + out + P_DRAWN, best)
                tl.store(part_i_ptr + out + P_DRAWN_TOKEN, at)


@triton.jit(do_not_specialize_on_alignment=ROWS_PTR)
def _pivot_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, plan_f_ptr, plan_i_ptr,
                  pivot_n_ptr, pivot_m_ptr, vocab, chunk, num_chunks, CAP: tl.constexpr, P: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Program (i, s) of a (rows, S) grid: row i's chunks s, s + S, ..."""
    i = tl.program_id(0)
    _, entry, flags = _row(rows_ptr, table_ptr, i)
    if _overflowed(plan_i_ptr, i, flags, CAP):
        raw, processed, use_processed = _scores(logits_ptr, stride_logits, processed_ptr, entry, flags, i, vocab)
        inv_t = _float_at(entry, C_INV_TEMPERATURE)
        top = tl.load(plan_f_ptr + i * PLAN + L_TOP)
        pivots = _pivots(tl.load(plan_f_ptr + i * PLAN + L_LO), top, P)
        for c in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
            start = c * chunk
            end = tl.minimum(start + chunk, vocab)
            if (flags & F_TOP_P) != 0:
                counts, masses = _pivot_stats(raw, processed, use_processed, start, end, inv_t, pivots, top, True,
                                              BLOCK, P)
            else:
                counts, masses = _pivot_stats(raw, processed, use_processed, start, end, inv_t, pivots, top, False,
                                              BLOCK, P)
            cells = (i * num_chunks + c) * P + tl.arange(0, P)
            tl.store(pivot_n_ptr + cells, counts)
            tl.store(pivot_m_ptr + cells, masses)


@triton.jit(do_not_specialize_on_alignment=ROWS_PTR)
def _bracket_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, keys_ptr, counters_ptr,
                    part_f_ptr, part_i_ptr, plan_f_ptr, plan_i_ptr, pivot_n_ptr, pivot_m_ptr, values_ptr, ids_ptr,
                    vocab, chunk, num_chunks, CAP: tl.constexpr, CHUNKS: tl.constexpr, P: tl.constexpr,
                    G: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, s) of a (rows, S) grid: row i's chunks s, s + S, ..."""
    i = tl.program_id(0)
    row, entry, flags = _row(rows_ptr, table_ptr, i)
    if _overflowed(plan_i_ptr, i, flags, CAP):
        top = tl.load(plan_f_ptr + i * PLAN + L_TOP)
        lo, hi, _, _, candidates = _bracket(pivot_n_ptr, pivot_m_ptr, i, num_chunks,
                                            tl.load(plan_f_ptr + i * PLAN + L_LO), top, tl.load(entry + C_TOP_K),
                                            tl.load(plan_f_ptr + i * PLAN + L_LIMIT), (flags & F_TOP_P) != 0,
                                            CHUNKS, P)
        if candidates <= CAP:
            raw, processed, use_processed = _scores(logits_ptr, stride_logits, processed_ptr, entry, flags, i, vocab)
            inv_t = _float_at(entry, C_INV_TEMPERATURE)
            key = tl.load(keys_ptr + row)
            counter = tl.load(counters_ptr + row)
            log_min_p = _log_min_p(entry, flags)
            for c in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
                start = c * chunk
                end = tl.minimum(start + chunk, vocab)
                _gather(raw, processed, use_processed, start, end, inv_t, lo, hi, plan_i_ptr + i * PLAN + L_BRACKETED,
                        values_ptr + i.to(tl.int64) * CAP, ids_ptr + i.to(tl.int64) * CAP, CAP, BLOCK)
                best, at = _restricted_best(raw, processed, use_processed, start, end, inv_t, key, counter, hi, top,
                                            log_min_p, G)
                out = (i * num_chunks + c) * PARTS
                tl.store(part_f_ptr + out + P_DRAWN, best)
                tl.store(part_i_ptr + out + P_DRAWN_TOKEN, at)
