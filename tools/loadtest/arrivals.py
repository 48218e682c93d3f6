"""When each request is sent: a gamma-interval arrival process, as vLLM's `bench serve` draws it."""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds after the run starts, one per request.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): the mean gap is always 1/rate,
    burstiness 1 is a Poisson process, smaller values bunch requests into bursts and larger ones
    space them evenly. rate=inf sends everything at once. The first request goes at time 0, so a
    run never starts with idle time that would count against its throughput.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {rate} and {burstiness}")
    if math.isinf(rate):
        return np.zeros(count)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    gaps[:1] = 0.0
    return np.cumsum(gaps)
