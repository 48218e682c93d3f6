"""The device sampler's draw (worker_svc/layers/sampling_kernels.py) replayed in numpy, vectorised
over many draws: the same Philox-4x32-10 noise per (key, counter, token), the same kept set
({z >= cut}, ties kept together) found by sorting instead of by the kernels' search, the same
Gumbel-max over it. Under Triton's interpreter the kernels' float32 arithmetic is numpy's, so a
kernel's token equals this replica's exactly; the replica is fast enough to draw thousands of
times, which the interpreted kernels are not.
"""
from __future__ import annotations

import math

import numpy as np

from common.sampling_bounds import seed_hash

SEARCH_DEPTH = 30.0
_M = np.uint64(0xFFFFFFFF)


def row_key(seed: int) -> int:
    """A seeded row's Philox key, as DeviceSampler derives it."""
    return seed_hash(seed, 2 ** 64 - 1) & (2 ** 63 - 1)


def philox(key: np.ndarray, c0: np.ndarray, c1: np.ndarray, c2: np.ndarray) -> list[np.ndarray]:
    """Philox-4x32 with 10 rounds as triton.language.random computes it (c3 = 0), broadcast
    over its arguments; returns the four uint32 outputs."""
    key = key.astype(np.uint64)
    k0, k1 = key & _M, key >> np.uint64(32)
    c = [np.broadcast_to(x, np.broadcast(c0, c1, c2, key).shape).astype(np.uint64) for x in (c0, c1, c2)]
    c0, c1, c2, c3 = c[0], c[1], c[2], np.zeros_like(c[0])
    for _ in range(10):
        hi_b, lo_b = _mul(0xCD9E8D57, c2)
        hi_a, lo_a = _mul(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M
    return [x.astype(np.uint32) for x in (c0, c1, c2, c3)]


def _mul(a: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    product = np.uint64(a) * b   # both below 2**32: exact in uint64
    return product >> np.uint64(32), product & _M


def gumbel(keys: np.ndarray, counters: np.ndarray, vocab: int) -> np.ndarray:
    """float32 noise [draws, vocab] for rows with keys [draws] and counters [draws]."""
    keys = np.asarray(keys, np.int64).astype(np.uint64)[:, None]
    counters = np.asarray(counters, np.int64).astype(np.uint64)[:, None]
    groups = np.arange(-(-vocab // 4), dtype=np.uint64)[None, :]
    lanes = philox(keys, groups, counters & _M, counters >> np.uint64(32))
    r = np.stack(lanes, axis=-1).reshape(len(keys), -1)[:, :vocab]
    return -np.log(-np.log(uniform(r)))


def uniform(r: np.ndarray) -> np.ndarray:
    """float32 in (0, 1) from uint32 random bits, as the kernels convert them."""
    return ((r >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)


def kept(z: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """bool [vocab]: the tokens a row with these options may draw, given its z (float32)."""
    top = z.max()
    keep = np.ones_like(z, dtype=bool)
    if 0 < top_k < len(z) or top_p < 1.0:
        keep &= z >= top - np.float32(SEARCH_DEPTH)
    if 0 < top_k < len(z):
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1.0:
        e = np.exp(z - top)
        limit = np.float32(top_p) * e[keep].sum(dtype=np.float32)
        beaten = np.array([e[keep & (z > v)].sum(dtype=np.float32) for v in z])
        keep &= beaten < limit
    if min_p > 0.0:
        keep &= z - top >= np.float32(math.log(min_p))
    return keep


def draw(scores: np.ndarray, temperature: float, keys, counters, **truncation) -> np.ndarray:
    """Tokens [draws] of one row of scores (float32 [vocab]) drawn with each (key, counter)."""
    z = scores.astype(np.float32) * np.float32(1.0 / temperature)
    allowed = kept(z, **truncation)
    noisy = np.where(allowed[None, :], z[None, :] + gumbel(keys, counters, len(z)), -np.inf)
    return noisy.argmax(-1)
