"""bench/probes/small_gemm's Triton GEMM (the candidate it times against cuBLAS) computes F.linear: ragged M, N and
K, unsplit and split over K (its float32 atomics), interpreted on the CPU as a GPU would run it."""
from __future__ import annotations

import pytest

from tests.support.triton_interpreter import INTERPRETED, gpu_faithful


@pytest.mark.skipif(not INTERPRETED, reason="the interpreted check; on a GPU the probe checks each config itself")
def test_the_probe_gemm_computes_f_linear():
    from bench.probes import small_gemm

    with gpu_faithful():
        small_gemm.check()
