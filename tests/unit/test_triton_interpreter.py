"""The interpreter's speed-ups (tools/triton_interpreter.py, on for the whole session) compute what
Triton's own interpreter computes: tl.philox's rounds in numpy give Triton's interpreted rounds'
words, bit for bit, on random keys and counters. gpu_faithful() widens bfloat16 as a GPU does.
Only without CUDA (on a GPU nothing is patched)."""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="patches Triton's interpreter only")


def philox_words(seeds: torch.Tensor, counters: torch.Tensor, G: int) -> torch.Tensor:
    """tl.philox of each seed with counters (c, c + 1, ~c, 7) for the G counters of its row: [rows, 4, G]."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(seed_ptr, counter_ptr, out_ptr, G: tl.constexpr):
        row = tl.program_id(0)
        g = tl.arange(0, G)
        c = tl.load(counter_ptr + row * G + g)
        r0, r1, r2, r3 = tl.philox(tl.load(seed_ptr + row), c, c + 1, ~c, c * 0 + 7)
        base = out_ptr + row * 4 * G + g
        tl.store(base, r0)
        tl.store(base + G, r1)
        tl.store(base + 2 * G, r2)
        tl.store(base + 3 * G, r3)

    out = torch.zeros(len(seeds), 4, G, dtype=torch.int32, device=DEVICE)
    kernel[(len(seeds),)](seeds, counters, out, G=G)
    return out


def test_philox_in_numpy_gives_the_interpreted_rounds_words():
    import triton.language as tl

    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (3,), generator=g, dtype=torch.int64)
    counters = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 16), generator=g, dtype=torch.int32)
    fast = philox_words(seeds, counters, 16)
    numpy_rounds = tl.random.philox_impl
    tl.random.philox_impl = numpy_rounds.original
    try:
        interpreted = philox_words(seeds, counters, 16)
    finally:
        tl.random.philox_impl = numpy_rounds
    assert torch.equal(fast, interpreted)
    assert len(set(fast.flatten().tolist())) > 150         # 192 words: not a constant


def test_gpu_faithful_widens_every_bfloat16_exactly():
    """bfloat16 -> float32 in a kernel gives torch's float32 for all 65,536 patterns (subnormals,
    infinities and NaNs included), as a compiled kernel's exact widening does."""
    import triton
    import triton.language as tl

    from tests.support.triton_interpreter import gpu_faithful

    @triton.jit
    def widen(src_ptr, out_ptr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(src_ptr + offsets).to(tl.float32))

    patterns = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    out = torch.empty(len(patterns), dtype=torch.float32, device=DEVICE)
    with gpu_faithful():
        widen[(len(patterns) // 4096,)](patterns.to(DEVICE), out, BLOCK=4096)
    assert torch.equal(out.cpu().view(torch.int32), patterns.float().view(torch.int32))
