"""Triton kernels that sample a batch of logits rows on the device, with no sort of the vocabulary,
no host synchronisation and no allocation, so a decode step can capture them in its CUDA graph.

Each row's options live in a table indexed by the row of the persistent batch (device_sampler.py
writes it when a row changes hands); a launch reads the rows of its batch from a device tensor.
A drawing row's token is the Gumbel-max over its kept set: argmax(z + g), z = score / T, g Gumbel
noise from Philox keyed by the row's (key, counter) and the token id, the first token on a tie;
greedy rows take the argmax of the score. Whichever path below finds it, the token depends only on
the row's logits, options and (key, counter): never on the batch. Launches in order ("a pass"
reads the row's logits once; the others read a few numbers per row; the plan, gather, pivot and
bracket kernels are in sampling_cut.py, the finish kernel in sampling_finish.py):
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

This module holds what the passes share (the row table's flags and columns, the partials' and the
plan's layout, the rows' scores, the Gumbel noise, the scan) and the first two passes.
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

# The rows each kernel samples: in an eager step a view into the step's staging copy, at an offset
# that follows the step's sizes (8-byte aligned, 16 only at times). Specialised on its alignment,
# every kernel would compile a second variant mid-serving (found by tools/sm90_compile.py).
ROWS_PTR = ["rows_ptr"]

SEARCH_DEPTH = tl.constexpr(30.0)   # nats below the top where a truncating row stops looking
NO_TOKEN = tl.constexpr(2 ** 30)

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


# --- shared pieces -------------------------------------------------------------------------------

@triton.jit
def _float_at(entry, column):
    return tl.load(entry + column).to(tl.float32, bitcast=True)


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
def _log_min_p(entry, flags):
    """The row's log(min_p); -inf without min-p."""
    return tl.where((flags & F_MIN_P) != 0, _float_at(entry, C_LOG_MIN_P), float("-inf"))


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


# --- the scan's survey of a truncating row, and the logprobs' log-sum-exp ------------------------

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


# --- the kernels ---------------------------------------------------------------------------------

@triton.jit
def _penalized(x, in_prompt, counts, repetition, presence, frequency):
    """The penalties as PenaltyTable.apply computes them (layers/penalties.py)."""
    seen = in_prompt | (counts > 0)
    x = tl.where(seen, tl.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts.to(tl.float32) - presence * (counts > 0).to(tl.float32)


@triton.jit(do_not_specialize_on_alignment=ROWS_PTR)
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


@triton.jit(do_not_specialize_on_alignment=ROWS_PTR)
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
