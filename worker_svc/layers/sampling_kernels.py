"""Triton kernels that sample a batch of logits rows on the device, with no sort of the vocabulary,
no host synchronisation and no allocation, so a decode step can capture them in its CUDA graph.

Each row's options live in a table indexed by the row of the persistent batch (device_sampler.py
writes it when a row changes hands); a launch reads the rows of its batch from a device tensor.
A drawing row's token is the Gumbel-max over its kept set: argmax(z + g), z = score / T, g Gumbel
noise from Philox keyed by the row's (key, counter) and the token id, the first token on a tie;
greedy rows take the argmax of the score. Whichever path below finds it, the token depends only on
the row's logits, options and (key, counter): never on the batch. Launches in order ("a pass"
reads the row's logits once; the others read a few numbers per row):
- `_penalize_kernel` (a pass, rows with penalties or a logit bias): their processed scores, in
  float32, in a slot of their own (the bias first, then the penalties, as layers/sampler.py does).
- `_scan_kernel` (a pass, per chunk of the vocabulary): greedy rows' argmax; plain rows' draw
  (noise for every token); truncating rows (top-k, top-p, min-p) draw nothing here, so their
  noise is spent only on kept tokens later: the largest z, the largest z of each group of a few
  tokens, and for top-p without top-k the mass sum(exp(z - top)) (a second loop over the chunk,
  which L2 still holds). The raw logits' log-sum-exp, for the sampled token's logprob.
- `_plan_kernel` (per row): from the group maxima, a bound lo below which no token is kept. Top-k:
  k groups reach lo, so k tokens do. Top-p without top-k: the maxima above lo alone hold the mass
  p * total, so the tokens above lo do. Bisected to within 30 nats / 2**ROUNDS of the best bound;
  min-p raises it to just below its own threshold (unless top-p must weigh the whole top-k set).
- `_gather_kernel` (a pass): top-k/top-p rows append every token with z >= lo (value, id) to the
  row's buffer (places taken by an atomic counter; only the set matters, not its order). Min-p
  rows, whose cut is exact once the top is known, draw here, noise only for tiles with kept tokens.
- `_pivot_kernel`, `_bracket_kernel` (a pass each, only rows whose gathered set overflowed, with
  top-k or top-p but not both): counts (and masses) at pivots from lo to the top bracket the cut;
  the bracket's candidates are gathered and the tokens above it drawn from (noise as above).
- `_finish_kernel` (per row): sorts the gathered values, finds the exact cut and draws over the
  kept gathered tokens (noise for those alone). A row whose bracket overflowed too (or with top-k
  and top-p both) takes the single-program search: an unrestricted draw, counts at it, and when it
  is not kept, pivot rounds to the cut and a redraw over the kept set. It then advances the row's
  counter, stores the token as the row's newest and counts it into the row's penalty table.
The passes that most rows skip (penalties, gather, pivots, bracket) run S programs per row, each
over every S-th chunk, so that a batch launches a bounded number of programs to skip them.

Passes over a row's logits per call, before this scheme (a verify pass, then one program per row
searching) and now; a penalty pass comes on top of both, for rows with penalties or a bias:
- temperature: 1 -> 1.
- min-p: 1, or 2 when the draw fails min-p (the redraw: one program, noise for every token) ->
  2 (noise only in the tiles holding a kept token).
- top-k, top-p: 2 (draw, verify), and when the draw is not kept, 2 + R more by one program per
  row for top-k, 3 + R for top-p (R >= 1 rounds of 4 pivots until <= 2,048 candidates, their
  gather, top-p's mass, the redraw with noise for every token) -> 2 (+ top-p alone re-reads each
  chunk from L2 for the mass) when the gathered set fits the buffer: top-k with k below ~4,000,
  top-p whose kept set and its bound's slack do; 4 when it overflows (top-k or top-p
  alone); when the bracket overflows too, or with top-k and top-p both past the buffer (thousands
  of ties at the cut), the single-program search as before: 2 passes, + R + 2 or 3 when its draw
  is not kept. That is the bounded worst case (MAX_ROUNDS pivot rounds at most).

The kept set is {z >= cut} (ties at the cut are kept together): top-k keeps the tokens fewer than
k others beat; top-p, applied over the top-k set renormalised, keeps the tokens that the mass of
the tokens beating them leaves under p; min-p keeps z - max z >= log(min_p). Tokens more than
SEARCH_DEPTH nats below the top are never kept by a top-k or top-p row (their probability is
below e**-30 each). A row whose penalties made its scores unusable (NaN, +inf, or no finite value)
is sampled from its raw logits; a drawing row whose z is unusable takes the raw argmax (as
layers/logits_guard.py decides for the torch path).
"""
from __future__ import annotations

import triton
import triton.language as tl

# Per-row flags (table column FLAGS).
F_GREEDY = tl.constexpr(1)
F_LOGPROB = tl.constexpr(2)
F_PROCESSED = tl.constexpr(4)    # penalties or a bias: read the row's processed slot
F_PENALTY = tl.constexpr(8)
F_TOP_K = tl.constexpr(16)
F_TOP_P = tl.constexpr(32)
F_MIN_P = tl.constexpr(64)

# Columns of the int32 row table (floats are stored as their bits).
C_FLAGS = tl.constexpr(0)
C_TOP_K = tl.constexpr(1)
C_PENALTY_ROW = tl.constexpr(2)
C_SLOT = tl.constexpr(3)
C_NUM_BIAS = tl.constexpr(4)
C_INV_TEMPERATURE = tl.constexpr(5)
C_TOP_P = tl.constexpr(6)
C_LOG_MIN_P = tl.constexpr(7)
C_REPETITION = tl.constexpr(8)
C_PRESENCE = tl.constexpr(9)
C_FREQUENCY = tl.constexpr(10)
NUM_COLUMNS = 16                    # the host's view; kernels read ROW_COLUMNS
ROW_COLUMNS = tl.constexpr(NUM_COLUMNS)

SEARCH_DEPTH = tl.constexpr(30.0)   # nats below the top where a truncating row stops looking
NO_TOKEN = tl.constexpr(2 ** 30)
MASS_MARGIN = tl.constexpr(1e-3)    # the top-p bound's slack over float32 rounding of mass sums
MIN_P_SLACK = tl.constexpr(1e-5)    # a gather's min-p bound sits this far (relative) below the exact test

# Values per (row, chunk) in the partials buffers. Floats: the best score, the top z, the raw
# logits' max and sum of exp, the top-p survey's mass, a restricted draw's best score; ints: the
# best token, bad, a restricted draw's token.
NUM_PARTS = 6
PARTS = tl.constexpr(NUM_PARTS)
P_BEST, P_TOP, P_RAW_TOP, P_RAW_SUM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
P_MASS, P_DRAWN = tl.constexpr(4), tl.constexpr(5)
P_TOKEN, P_BAD, P_DRAWN_TOKEN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)

# A row's plan. Floats: lo, the top z, the top-p limit (p * total mass, top-p without top-k);
# ints: the mode, the gathered count, the bracket's count.
NUM_PLAN = 4
PLAN = tl.constexpr(NUM_PLAN)
L_LO, L_TOP, L_LIMIT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
L_MODE, L_GATHERED, L_BRACKETED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
MODE_NONE = tl.constexpr(0)         # greedy, plain and unusable rows: nothing between scan and finish
MODE_GATHER = tl.constexpr(1)       # top-k or top-p (with or without min-p)
MODE_MIN_P = tl.constexpr(2)        # min-p alone


# --- shared pieces ------------------------------------------------------------------------------

@triton.jit
def _float_at(entry, column):
    return tl.load(entry + column).to(tl.float32, bitcast=True)


@triton.jit
def _load_scores(raw_ptr, processed_ptr, use_processed, offsets, mask):
    """float32 scores at offsets: the row's processed slot, or its raw logits."""
    if use_processed:
        x = tl.load(processed_ptr + offsets, mask=mask, other=float("-inf"))
    else:
        x = tl.load(raw_ptr + offsets, mask=mask, other=float("-inf")).to(tl.float32)
    return x


@triton.jit
def _gumbel(key, counter, base, G: tl.constexpr):
    """Gumbel noise [G, 4] of tokens base + 4g + j: Philox-4x32 keyed by the row's key, counting
    (token // 4, counter). u = (23 random bits + 1/2) / 2**23 lies in [2**-24, 1 - 2**-24], exactly
    in float32 (with 24 bits the largest would round up to 1.0: infinite noise), so the noise is
    finite."""
    g = tl.arange(0, G)
    j = tl.arange(0, 4)[None, :]
    c0 = (base // 4 + g).to(tl.uint32)
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(key, c0, zero + counter.to(tl.uint32), zero + (counter >> 32).to(tl.uint32), zero)
    r = tl.where(j == 0, r0[:, None], tl.where(j == 1, r1[:, None], tl.where(j == 2, r2[:, None], r3[:, None])))
    u = ((r >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _scan(raw_ptr, processed_ptr, use_processed, start, end, inv_t, key, counter, cut, top, log_min_p,
          DRAW: tl.constexpr, RESTRICT: tl.constexpr, G: tl.constexpr):
    """Over tokens [start, end): the best score and its first token, the largest z, and whether a
    value is NaN or +inf. DRAW: the score is z + noise and the values checked are z; else both are
    the scores as loaded. RESTRICT: only tokens with z >= cut and z - top >= log_min_p compete."""
    g = tl.arange(0, G)[:, None]
    j = tl.arange(0, 4)[None, :]
    best = tl.full([G, 4], float("-inf"), tl.float32)
    best_at = start + 4 * g + j
    z_max = tl.full([G, 4], float("-inf"), tl.float32)
    bad = tl.zeros([G, 4], tl.int32)
    for base in range(start, end, 4 * G):
        tokens = base + 4 * g + j
        x = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < end)
        if DRAW:
            z = x * inv_t
            z_max = tl.maximum(z_max, z)
            score = z + _gumbel(key, counter, base, G)
            if RESTRICT:
                score = tl.where((z >= cut) & (z - top >= log_min_p), score, float("-inf"))
        else:
            z = x
            score = x
        bad |= ((z != z) | (z == float("inf"))).to(tl.int32)
        better = score > best
        best = tl.where(better, score, best)
        best_at = tl.where(better, tokens, best_at)
    winner = tl.max(best)
    if not DRAW:
        z_max = best
    return winner, tl.min(tl.where(best == winner, best_at, NO_TOKEN)), tl.max(z_max), tl.max(bad)


# --- a truncating row's cut from its gathered tokens ---------------------------------------------

@triton.jit
def _gumbel_at(key, counter, tokens):
    """The noise of `tokens` (any shape), bit for bit what _gumbel gives them in their tile."""
    c0 = (tokens // 4).to(tl.uint32)
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(key, c0, zero + counter.to(tl.uint32), zero + (counter >> 32).to(tl.uint32), zero)
    lane = tokens % 4
    r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    u = ((r >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _survey(raw_ptr, processed_ptr, use_processed, start, end, inv_t, G: tl.constexpr, LANES: tl.constexpr):
    """Over tokens [start, end): the largest z, whether a z is NaN or +inf, and the largest z of each
    group of LANES neighbouring lanes of a tile row, across the chunk's tiles ([G * 4 // LANES])."""
    g = tl.arange(0, G)[:, None]
    j = tl.arange(0, 4)[None, :]
    z_max = tl.full([G, 4], float("-inf"), tl.float32)
    bad = tl.zeros([G, 4], tl.int32)
    for base in range(start, end, 4 * G):
        tokens = base + 4 * g + j
        z = _load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < end) * inv_t
        z_max = tl.maximum(z_max, z)
        bad |= ((z != z) | (z == float("inf"))).to(tl.int32)
    groups = tl.max(tl.reshape(z_max, [G, 4 // LANES, LANES]), axis=2)
    return tl.max(z_max), tl.max(bad), tl.reshape(groups, [G * (4 // LANES)])


@triton.jit
def _mass_parts(raw_ptr, processed_ptr, use_processed, start, end, inv_t, top, BLOCK: tl.constexpr):
    """Sum of exp(z - top) over tokens [start, end)."""
    mass = tl.zeros([BLOCK], tl.float32)
    for base in range(start, end, BLOCK):
        tokens = base + tl.arange(0, BLOCK)
        mass += tl.exp(_load_scores(raw_ptr, processed_ptr, use_processed, tokens, tokens < end) * inv_t - top)
    return tl.sum(mass)


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
def _combined_best(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS: tl.constexpr):
    """A restricted draw over all the row's chunks: (its score, its token)."""
    c = tl.arange(0, CHUNKS)
    valid = c < num_chunks
    at = (i * num_chunks + c) * PARTS
    best = tl.load(part_f_ptr + at + P_DRAWN, mask=valid, other=float("-inf"))
    winner = tl.max(best)
    tokens = tl.load(part_i_ptr + at + P_DRAWN_TOKEN, mask=valid, other=NO_TOKEN)
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
            above, above_token = _combined_best(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS)
            if (above > best) | ((above == best) & (above_token < token)):
                token = above_token
    return token, cut, alone


# --- the single-program search (a row whose kept set overflows the buffer) ------------------------

@triton.jit
def _log_sum_exp_parts(raw_ptr, start, end, BLOCK: tl.constexpr):
    """(max, sum of exp(x - max)) of the raw logits over [start, end)."""
    top = float("-inf")
    total = 0.0
    for base in range(start, end, BLOCK):
        tokens = base + tl.arange(0, BLOCK)
        x = tl.load(raw_ptr + tokens, mask=tokens < end, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x))
        if new_top > float("-inf"):
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top))
            top = new_top
    return top, total


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


# --- the kernels ---------------------------------------------------------------------------------

@triton.jit
def _penalized(x, in_prompt, counts, repetition, presence, frequency):
    """The penalties as PenaltyTable.apply computes them (layers/penalties.py)."""
    seen = in_prompt | (counts > 0)
    x = tl.where(seen, tl.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts.to(tl.float32) - presence * (counts > 0).to(tl.float32)


@triton.jit
def _penalize_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, prompt_mask_ptr, counts_ptr,
                     bias_ids_ptr, bias_values_ptr, vocab, chunk, num_chunks, MAX_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Program (i, s) of a (rows, S) grid: row i's chunks s, s + S, ..."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    entry = table_ptr + row * ROW_COLUMNS
    flags = tl.load(entry + C_FLAGS)
    if (flags & F_PROCESSED) != 0:
        penalize = (flags & F_PENALTY) != 0
        penalty_row = tl.load(entry + C_PENALTY_ROW).to(tl.int64) * vocab
        repetition = _float_at(entry, C_REPETITION)
        presence = _float_at(entry, C_PRESENCE)
        frequency = _float_at(entry, C_FREQUENCY)
        num_bias = tl.load(entry + C_NUM_BIAS)
        src = logits_ptr + i.to(tl.int64) * stride_logits
        dst = processed_ptr + tl.load(entry + C_SLOT).to(tl.int64) * vocab
        for c in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
            start = c * chunk
            end = tl.minimum(start + chunk, vocab)
            for base in range(start, end, BLOCK):
                tokens = base + tl.arange(0, BLOCK)
                mask = tokens < end
                x = tl.load(src + tokens, mask=mask, other=0.0).to(tl.float32)
                if penalize:
                    x = _penalized(x, tl.load(prompt_mask_ptr + penalty_row + tokens, mask=mask, other=0) != 0,
                                   tl.load(counts_ptr + penalty_row + tokens, mask=mask, other=0),
                                   repetition, presence, frequency)
                tl.store(dst + tokens, x, mask=mask)
            if num_bias > 0:
                tl.debug_barrier()   # the biased tokens overwrite what other threads stored above
                b = tl.arange(0, MAX_BIAS)
                ids = tl.load(bias_ids_ptr + row * MAX_BIAS + b, mask=b < num_bias, other=-1)
                mask = (b < num_bias) & (ids >= start) & (ids < end)
                x = tl.load(src + ids, mask=mask, other=0.0).to(tl.float32)
                x += tl.load(bias_values_ptr + row * MAX_BIAS + b, mask=mask, other=0.0)
                if penalize:
                    x = _penalized(x, tl.load(prompt_mask_ptr + penalty_row + ids, mask=mask, other=0) != 0,
                                   tl.load(counts_ptr + penalty_row + ids, mask=mask, other=0),
                                   repetition, presence, frequency)
                tl.store(dst + ids, x, mask=mask)


@triton.jit
def _row(rows_ptr, table_ptr, i):
    """The row's table entry and flags."""
    row = tl.load(rows_ptr + i).to(tl.int64)
    entry = table_ptr + row * ROW_COLUMNS
    return row, entry, tl.load(entry + C_FLAGS)


@triton.jit
def _scores(logits_ptr, stride_logits, processed_ptr, entry, flags, i, vocab):
    """The row's raw logits, its processed slot, and whether it reads the slot."""
    raw = logits_ptr + i.to(tl.int64) * stride_logits
    processed = processed_ptr + tl.load(entry + C_SLOT).to(tl.int64) * vocab
    return raw, processed, (flags & F_PROCESSED) != 0


@triton.jit
def _scan_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, keys_ptr, counters_ptr,
                 part_f_ptr, part_i_ptr, groups_ptr, vocab, chunk, num_chunks, G: tl.constexpr, LANES: tl.constexpr,
                 BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    row, entry, flags = _row(rows_ptr, table_ptr, i)
    raw, processed, use_processed = _scores(logits_ptr, stride_logits, processed_ptr, entry, flags, i, vocab)
    inv_t = _float_at(entry, C_INV_TEMPERATURE)
    key = tl.load(keys_ptr + row)
    counter = tl.load(counters_ptr + row)
    out = (i * num_chunks + c) * PARTS
    if (flags & F_GREEDY) != 0:
        best, at, top, bad = _scan(raw, processed, use_processed, start, end, inv_t, key, counter,
                                   0.0, 0.0, 0.0, False, False, G)
    elif (flags & (F_TOP_K | F_TOP_P | F_MIN_P)) != 0:
        best = float("-inf")
        at = NO_TOKEN
        top, bad, groups = _survey(raw, processed, use_processed, start, end, inv_t, G, LANES)
        if (flags & (F_TOP_K | F_TOP_P)) != 0:
            cells = (i * num_chunks + c).to(tl.int64) * (G * (4 // LANES)) + tl.arange(0, G * (4 // LANES))
            tl.store(groups_ptr + cells, groups)
        mass = 0.0
        if ((flags & F_TOP_P) != 0) & ((flags & F_TOP_K) == 0) & (top > float("-inf")):
            mass = _mass_parts(raw, processed, use_processed, start, end, inv_t, top, BLOCK)
        tl.store(part_f_ptr + out + P_MASS, mass)
    else:
        best, at, top, bad = _scan(raw, processed, use_processed, start, end, inv_t, key, counter,
                                   0.0, 0.0, 0.0, True, False, G)
    raw_top = float("-inf")
    raw_sum = 0.0
    if (flags & F_LOGPROB) != 0:
        raw_top, raw_sum = _log_sum_exp_parts(raw, start, end, BLOCK)
    tl.store(part_f_ptr + out + P_BEST, best)
    tl.store(part_f_ptr + out + P_TOP, top)
    tl.store(part_f_ptr + out + P_RAW_TOP, raw_top)
    tl.store(part_f_ptr + out + P_RAW_SUM, raw_sum)
    tl.store(part_i_ptr + out + P_TOKEN, at)
    tl.store(part_i_ptr + out + P_BAD, bad)


@triton.jit
def _combined_scan(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS: tl.constexpr):
    """The row's scan over all its chunks: (its token, top z, bad, raw max, raw sum of exp)."""
    c = tl.arange(0, CHUNKS)
    valid = c < num_chunks
    at = (i * num_chunks + c) * PARTS
    best = tl.load(part_f_ptr + at + P_BEST, mask=valid, other=float("-inf"))
    winner = tl.max(best)
    tokens = tl.load(part_i_ptr + at + P_TOKEN, mask=valid, other=NO_TOKEN)
    token = tl.min(tl.where(valid & (best == winner), tokens, NO_TOKEN))
    top = tl.max(tl.load(part_f_ptr + at + P_TOP, mask=valid, other=float("-inf")))
    bad = tl.max(tl.load(part_i_ptr + at + P_BAD, mask=valid, other=0))
    raw_tops = tl.load(part_f_ptr + at + P_RAW_TOP, mask=valid, other=float("-inf"))
    raw_top = tl.max(raw_tops)
    scale = tl.where(raw_tops > float("-inf"), tl.exp(raw_tops - raw_top), 0.0)
    raw_sum = tl.sum(tl.load(part_f_ptr + at + P_RAW_SUM, mask=valid, other=0.0) * scale)
    return token, top, bad, raw_top, raw_sum


@triton.jit
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


@triton.jit
def _log_min_p(entry, flags):
    """The row's log(min_p); -inf without min-p."""
    return tl.where((flags & F_MIN_P) != 0, _float_at(entry, C_LOG_MIN_P), float("-inf"))


@triton.jit
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


@triton.jit
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


@triton.jit
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


@triton.jit
def _raw_argmax(raw_ptr, processed_ptr, vocab, G: tl.constexpr):
    _, token, _, _ = _scan(raw_ptr, processed_ptr, False, 0, vocab, 1.0, 0, 0, 0.0, 0.0, 0.0, False, False, G)
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


@triton.jit
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
        _, token = _combined_best(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS)
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
