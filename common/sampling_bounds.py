"""The bounds of a request's sampling options and the seed of each sample: one copy, read by the
frontend's validation, the worker and the OpenAI gateway.

No protobuf and no torch here (xxhash, which every image installs, is the only import beyond the
standard library), so any process can read it. Float bounds are compared as float32, the type of
every sampling float on the wires: a client's 0.01 arrives as 0.0099999998 and is still in range.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import xxhash

MAX_N = 16                        # samples of one request
MAX_TOP_LOGPROBS = 20             # most likely tokens per position
MAX_LOGIT_BIAS_ENTRIES = 1024     # token ids one request may bias
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256         # characters; the stop-string matcher holds back up to this many
MAX_STOP_TOKEN_IDS = 256          # a chat template ends on a handful; each is a set lookup
SEED_LIMIT = 2 ** 64              # seeds are uint64
# Encoded llm.v1 sampling options within the bounds above, a constraint aside, take less than
# half of this (their strings in 4-byte characters, every id a 5-byte varint).
MAX_SAMPLING_BYTES = 64 << 10


def to_float32(value: float) -> float:
    """`value` rounded to float32, as a proto float field stores it (past its range: +-inf)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


@dataclass(frozen=True, slots=True)
class FloatRange:
    """A closed interval, or (low, high] when low_open; finite values only."""
    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        low, high = to_float32(self.low), to_float32(self.high)
        if not math.isfinite(value) or value < low or value > high:
            return False
        return not (self.low_open and value == low)

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# Ranges in which the sampler's arithmetic stays finite for finite logits (a repetition penalty
# near 0 would divide logits by it), by the field name they bound on every side.
FLOAT_RANGES = {
    "temperature": FloatRange(0.0, 100.0),
    "top_p": FloatRange(0.0, 1.0, low_open=True),
    "min_p": FloatRange(0.0, 1.0),
    "repetition_penalty": FloatRange(0.01, 10.0),
    "presence_penalty": FloatRange(-2.0, 2.0),
    "frequency_penalty": FloatRange(-2.0, 2.0),
}
LOGIT_BIAS_RANGE = FloatRange(-100.0, 100.0)


def seed_hash(seed: int, index: int) -> int:
    """xxh64 of (seed, index) as two little-endian uint64: a seed derived from a seed."""
    return xxhash.xxh64_intdigest(struct.pack("<QQ", seed & 0xFFFF_FFFF_FFFF_FFFF, index))


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for sample 0
    (so n = 1 and sample 0 of n > 1 draw the same tokens), seed_hash(seed, index) for the others."""
    return seed if index == 0 else seed_hash(seed, index)
