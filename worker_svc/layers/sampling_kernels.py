"""Triton kernels that sample a batch of logits rows on the device, with no sort of the vocabulary,
no host synchronisation and no allocation, so a decode step can capture them in its CUDA graph.

Each row's options live in a table indexed by the row of the persistent batch (device_sampler.py
writes it when a row changes hands); a launch reads the rows of its batch from a device tensor.
Four launches, each a pass over the logits:
- `_penalize_kernel`: rows with penalties or a logit bias get their processed scores, in float32,
  in a slot of their own (the bias first, then the penalties, as layers/sampler.py applies them).
- `_scan_kernel`: per chunk of the vocabulary, the draw: the Gumbel-max over z = score / T,
  `argmax(z + g)`, where g is Gumbel noise from Philox keyed by the row's (key, counter) and the
  token id; greedy rows take the argmax of the score. Also the largest z and the raw logits'
  log-sum-exp (for the sampled token's logprob).
- `_verify_kernel`: for rows with top-k or top-p, whether the drawn token is in the kept set:
  how many tokens beat it and their probability mass.
- `_finish_kernel`: one program per row combines the chunks and writes the token. A draw outside
  the kept set is redrawn as the Gumbel-max over the kept set with the same noise, after a search
  for the set's threshold: pivots evenly spaced between a bound known to fail and one known to
  hold, counted in passes over the row, until few enough tokens are left between them to gather
  and sort. The result is always argmax(z + g) over the kept set, whichever path found it, so a
  row's token depends only on its logits, its options and its (key, counter): never on the batch.
  It then advances the row's counter, stores the token as the row's newest, and counts it into the
  row's penalty table.

The kept set is {z >= cut} (ties at the cut are kept together): top-k keeps the tokens fewer than
k others beat; top-p, applied over the top-k set renormalised, keeps the tokens that the mass of
the tokens beating them leaves under p; min-p keeps z - max z >= log(min_p). Tokens more than
SEARCH_DEPTH nats below the top are never kept by a truncating row (their probability is below
e**-30 each). A row whose penalties made its scores unusable (NaN, +inf, or no finite value) is
sampled from its raw logits; a drawing row whose z is unusable takes the raw argmax (as
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
NUM_PARTS = 4                       # values per (row, chunk) in each partials buffer
PARTS = tl.constexpr(NUM_PARTS)


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


# --- the threshold search (one program, one row) -------------------------------------------------

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
                     bias_ids_ptr, bias_values_ptr, vocab, chunk, MAX_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    start = tl.program_id(1) * chunk
    end = tl.minimum(start + chunk, vocab)
    row = tl.load(rows_ptr + i).to(tl.int64)
    entry = table_ptr + row * ROW_COLUMNS
    flags = tl.load(entry + C_FLAGS)
    if (flags & F_PROCESSED) != 0:
        penalize = (flags & F_PENALTY) != 0
        penalty_row = tl.load(entry + C_PENALTY_ROW).to(tl.int64) * vocab
        repetition = _float_at(entry, C_REPETITION)
        presence = _float_at(entry, C_PRESENCE)
        frequency = _float_at(entry, C_FREQUENCY)
        src = logits_ptr + i.to(tl.int64) * stride_logits
        dst = processed_ptr + tl.load(entry + C_SLOT).to(tl.int64) * vocab
        for base in range(start, end, BLOCK):
            tokens = base + tl.arange(0, BLOCK)
            mask = tokens < end
            x = tl.load(src + tokens, mask=mask, other=0.0).to(tl.float32)
            if penalize:
                x = _penalized(x, tl.load(prompt_mask_ptr + penalty_row + tokens, mask=mask, other=0) != 0,
                               tl.load(counts_ptr + penalty_row + tokens, mask=mask, other=0),
                               repetition, presence, frequency)
            tl.store(dst + tokens, x, mask=mask)
        num_bias = tl.load(entry + C_NUM_BIAS)
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
def _scan_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, keys_ptr, counters_ptr,
                 part_f_ptr, part_i_ptr, vocab, chunk, num_chunks, G: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    row = tl.load(rows_ptr + i).to(tl.int64)
    entry = table_ptr + row * ROW_COLUMNS
    flags = tl.load(entry + C_FLAGS)
    use_processed = (flags & F_PROCESSED) != 0
    raw = logits_ptr + i.to(tl.int64) * stride_logits
    processed = processed_ptr + tl.load(entry + C_SLOT).to(tl.int64) * vocab
    inv_t = _float_at(entry, C_INV_TEMPERATURE)
    key = tl.load(keys_ptr + row)
    counter = tl.load(counters_ptr + row)
    if (flags & F_GREEDY) != 0:
        best, at, top, bad = _scan(raw, processed, use_processed, start, end, inv_t, key, counter,
                                   0.0, 0.0, 0.0, False, False, G)
    else:
        best, at, top, bad = _scan(raw, processed, use_processed, start, end, inv_t, key, counter,
                                   0.0, 0.0, 0.0, True, False, G)
    raw_top = float("-inf")
    raw_sum = 0.0
    if (flags & F_LOGPROB) != 0:
        raw_top, raw_sum = _log_sum_exp_parts(raw, start, end, BLOCK)
    out = (i * num_chunks + c) * PARTS
    tl.store(part_f_ptr + out, best)
    tl.store(part_f_ptr + out + 1, top)
    tl.store(part_f_ptr + out + 2, raw_top)
    tl.store(part_f_ptr + out + 3, raw_sum)
    tl.store(part_i_ptr + out, at)
    tl.store(part_i_ptr + out + 1, bad)


@triton.jit
def _combined_scan(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS: tl.constexpr):
    """The row's scan over all its chunks: (its token, top z, bad, raw max, raw sum of exp)."""
    c = tl.arange(0, CHUNKS)
    valid = c < num_chunks
    at = (i * num_chunks + c) * PARTS
    best = tl.load(part_f_ptr + at, mask=valid, other=float("-inf"))
    winner = tl.max(best)
    token = tl.min(tl.where(valid & (best == winner), tl.load(part_i_ptr + at, mask=valid, other=NO_TOKEN), NO_TOKEN))
    top = tl.max(tl.load(part_f_ptr + at + 1, mask=valid, other=float("-inf")))
    bad = tl.max(tl.load(part_i_ptr + at + 1, mask=valid, other=0))
    raw_tops = tl.load(part_f_ptr + at + 2, mask=valid, other=float("-inf"))
    raw_top = tl.max(raw_tops)
    scale = tl.where(raw_tops > float("-inf"), tl.exp(raw_tops - raw_top), 0.0)
    raw_sum = tl.sum(tl.load(part_f_ptr + at + 3, mask=valid, other=0.0) * scale)
    return token, top, bad, raw_top, raw_sum


@triton.jit
def _verify_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, part_f_ptr, part_i_ptr,
                   part_v_ptr, vocab, chunk, num_chunks, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    entry = table_ptr + row * ROW_COLUMNS
    flags = tl.load(entry + C_FLAGS)
    if ((flags & F_GREEDY) == 0) & ((flags & (F_TOP_K | F_TOP_P)) != 0):
        drawn, top, bad, _, _ = _combined_scan(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS)
        use_processed = (flags & F_PROCESSED) != 0
        raw = logits_ptr + i.to(tl.int64) * stride_logits
        processed = processed_ptr + tl.load(entry + C_SLOT).to(tl.int64) * vocab
        inv_t = _float_at(entry, C_INV_TEMPERATURE)
        z_drawn = _load_scores(raw, processed, use_processed, drawn, True) * inv_t
        counted = ((flags & F_MIN_P) == 0) | (z_drawn - top >= _float_at(entry, C_LOG_MIN_P))
        if counted & (bad == 0) & (top > float("-inf")):
            start = c * chunk
            end = tl.minimum(start + chunk, vocab)
            if (flags & F_TOP_P) != 0:
                beaten, above, at_least, total = _count_above(raw, processed, use_processed, start, end, inv_t,
                                                              z_drawn, top, True, BLOCK)
            else:
                beaten, above, at_least, total = _count_above(raw, processed, use_processed, start, end, inv_t,
                                                              z_drawn, top, False, BLOCK)
            out = (i * num_chunks + c) * PARTS
            tl.store(part_v_ptr + out, beaten.to(tl.float32))
            tl.store(part_v_ptr + out + 1, above)
            tl.store(part_v_ptr + out + 2, at_least)
            tl.store(part_v_ptr + out + 3, total)


@triton.jit
def _raw_argmax(raw_ptr, processed_ptr, vocab, G: tl.constexpr):
    _, token, _, _ = _scan(raw_ptr, processed_ptr, False, 0, vocab, 1.0, 0, 0, 0.0, 0.0, 0.0, False, False, G)
    return token


@triton.jit
def _draw_alone(raw_ptr, processed_ptr, vocab, inv_t, key, counter, flags, top_k, top_p, log_min_p, gather_ptr,
                G: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr,
                MAX_ROUNDS: tl.constexpr):
    """A drawing row's token from its raw logits, by one program's passes over the whole row."""
    _, drawn, top, bad = _scan(raw_ptr, processed_ptr, False, 0, vocab, inv_t, key, counter,
                               0.0, 0.0, 0.0, True, False, G)
    if (bad != 0) | (top == float("-inf")):
        token = _raw_argmax(raw_ptr, processed_ptr, vocab, G)
    else:
        z_drawn = _load_scores(raw_ptr, processed_ptr, False, drawn, True) * inv_t
        beaten, above, at_least, total = _count_above(raw_ptr, processed_ptr, False, 0, vocab, inv_t,
                                                      z_drawn, top, True, BLOCK)
        token = _redraw(raw_ptr, processed_ptr, False, vocab, inv_t, key, counter, flags, top_k, top_p,
                        log_min_p, drawn, top, beaten, above, at_least, total, gather_ptr,
                        G, BLOCK, NUM_PIVOTS, CAP, MAX_ROUNDS)
    return token


@triton.jit
def _finish_kernel(logits_ptr, stride_logits, processed_ptr, rows_ptr, table_ptr, keys_ptr, counters_ptr,
                   counts_ptr, part_f_ptr, part_i_ptr, part_v_ptr, gather_ptr, tokens_ptr, logprobs_ptr,
                   last_sampled_ptr, vocab, num_chunks, CHUNKS: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                   NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    entry = table_ptr + row * ROW_COLUMNS
    flags = tl.load(entry + C_FLAGS)
    raw = logits_ptr + i.to(tl.int64) * stride_logits
    processed = processed_ptr + tl.load(entry + C_SLOT).to(tl.int64) * vocab
    use_processed = (flags & F_PROCESSED) != 0
    inv_t = _float_at(entry, C_INV_TEMPERATURE)
    key = tl.load(keys_ptr + row)
    counter = tl.load(counters_ptr + row)
    top_k = tl.load(entry + C_TOP_K)
    top_p = _float_at(entry, C_TOP_P)
    log_min_p = _float_at(entry, C_LOG_MIN_P)
    gather = gather_ptr + i.to(tl.int64) * CAP
    token, top, bad, raw_top, raw_sum = _combined_scan(part_f_ptr, part_i_ptr, i, num_chunks, CHUNKS)
    unusable = (bad != 0) | (top == float("-inf"))
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
            token = _draw_alone(raw, processed, vocab, inv_t, key, counter, flags, top_k, top_p, log_min_p,
                                gather, G, BLOCK, NUM_PIVOTS, CAP, MAX_ROUNDS)
        else:
            token = _raw_argmax(raw, processed, vocab, G)
    elif (flags & (F_TOP_K | F_TOP_P | F_MIN_P)) != 0:
        c = tl.arange(0, CHUNKS)
        at = (i * num_chunks + c) * PARTS
        valid = c < num_chunks
        beaten = tl.sum(tl.load(part_v_ptr + at, mask=valid, other=0.0)).to(tl.int32)
        above = tl.sum(tl.load(part_v_ptr + at + 1, mask=valid, other=0.0))
        at_least = tl.sum(tl.load(part_v_ptr + at + 2, mask=valid, other=0.0))
        total = tl.sum(tl.load(part_v_ptr + at + 3, mask=valid, other=0.0))
        token = _redraw(raw, processed, use_processed, vocab, inv_t, key, counter, flags, top_k, top_p, log_min_p,
                        token, top, beaten, above, at_least, total, gather, G, BLOCK, NUM_PIVOTS, CAP, MAX_ROUNDS)
    tl.store(tokens_ptr + i, token.to(tl.int64))
    if (flags & F_LOGPROB) != 0:
        tl.store(logprobs_ptr + i, tl.load(raw + token).to(tl.float32) - raw_top - tl.log(raw_sum))
    else:
        tl.store(logprobs_ptr + i, 0.0)
    tl.store(last_sampled_ptr + row, token.to(tl.int64))
    tl.store(counters_ptr + row, counter + 1)
    if (flags & F_PENALTY) != 0:
        at = counts_ptr + tl.load(entry + C_PENALTY_ROW).to(tl.int64) * vocab + token
        tl.store(at, tl.load(at) + 1)
