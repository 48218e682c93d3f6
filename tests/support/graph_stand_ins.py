"""CUDA graphs on the CPU, for the tests of what captures them (worker_svc/cuda_graphs.py,
worker_svc/spec_decode/drafting_graphs.py): a capture runs its body once, eagerly, and a replay
runs nothing (UnreplayedGraph) or the captured body again (ReplayingGraph, its `body` set after
capture). On a GPU the real graphs' tests check the same, so these tests run on the CPU only."""
from __future__ import annotations

import contextlib

import pytest
import torch

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in for CUDA graphs (real ones run on a GPU)")


class UnreplayedGraph:
    def replay(self) -> None:
        pass


class ReplayingGraph:
    def __init__(self) -> None:
        self.body = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.body()


def capture_on_the_cpu(monkeypatch, graph_class: type = UnreplayedGraph) -> None:
    """torch.cuda's graph calls as `graph_class`, so graphs capture on the CPU."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_class)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
