"""Markers the test modules share."""
from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def requires_cuda(obj=None, *, reason: str = "needs a CUDA device"):
    """Marks a test (or a module's `pytestmark`) gpu and skips it without CUDA."""
    marks = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=reason)]
    if obj is None:
        return marks
    for mark in marks:
        obj = mark(obj)
    return obj
