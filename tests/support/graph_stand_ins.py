"""CUDA graphs on the CPU, for the tests of what captures them (worker_svc/cuda_graphs.py,
worker_svc/spec_decode/drafting_graphs.py): a capture runs its body once, eagerly, and a replay
runs nothing (UnreplayedGraph) or the captured body again (ReplayingGraph, its `body` set after
capture). On a GPU the real graphs' tests check the same, so these tests run on the CPU only.
`speculating_runner` builds a speculating runner whose graphs replay so, over an attention that reads
every length from the device (`graphs_on_the_cpu`)."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from tests.support.runner_driver import make_runner
from worker_svc import startup
from worker_svc.cuda_graphs import DecodeGraphs
from worker_svc.graph_inputs import DecodeInputs
from worker_svc.layers.attention.torch_backend import TorchAttentionBackend, causal_attention, gather_context

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


class DeviceLengthsAttention(TorchAttentionBackend):
    """The reference attention reading query and context lengths from the device tensors only, as
    a graph-capturable backend does; a row of length 0 (a graph's padding) attends to nothing."""
    supports_cuda_graphs = True
    supports_mixed_graphs = True

    def attend(self, q, k_cache, v_cache, meta, scale, kv_scales=None):
        out = torch.zeros_like(q)
        starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            if seq_len:
                table, rows = meta.block_tables[i], slice(starts[i], starts[i + 1])
                out[rows] = causal_attention(q[rows], gather_context(k_cache, table, seq_len),
                                             gather_context(v_cache, table, seq_len), scale)
        return out


def replaying_graphs_on_the_cpu(monkeypatch) -> None:
    """Graphs that replay their bodies, and runners made meanwhile on DeviceLengthsAttention (the
    `graphs_on_the_cpu` fixture of tests/conftest.py)."""
    capture_on_the_cpu(monkeypatch, ReplayingGraph)
    monkeypatch.setattr(startup, "select_backend", lambda runner: DeviceLengthsAttention())


def speculating_runner(model_dir, method: str, head_dir, graphed: bool, graph_requests: int = 4,
                       staged: bool = False):
    """A speculating runner, eager or (graphed) replaying graphs whose inputs are copied in, or
    (staged: the device sampler's, as on a GPU) unpacked by the graph from the step's staged columns."""
    runner = make_runner(model_dir, speculative_method=method, speculative_model=str(head_dir),
                         num_speculative_tokens=3, max_num_seqs=16, max_model_len=64,
                         speculative_graph_batch_size=graph_requests, sampler="kernels" if staged else "torch")
    if graphed:   # what startup.capture_decode_graphs does on a GPU, with the replays set to run their bodies
        forward = runner.model
        if runner.drafter.aux_layers:
            forward = functools.partial(runner.model, aux_layers=runner.drafter.aux_layers)
        inputs = (DecodeInputs(one_device_buffer(runner._staging), runner._decode_layout, runner.last_sampled,
                               runner.device_sampler.dummy_row) if staged else None)
        runner.decode_graphs = DecodeGraphs(forward, max_batch_size=runner.graph_tokens,
                                            max_blocks_per_seq=runner.max_blocks_per_seq,
                                            max_model_len=runner.max_model_len, device=runner.device, inputs=inputs)
        runner.drafter.capture_graphs(runner, runner.decode_graphs)
        for graphs in (runner.decode_graphs, runner.drafter.catch_up_graphs, runner.drafter.drafting_graphs):
            for size, graph in graphs.graphs.items():
                graph.body = functools.partial(graphs._captured, size)
    return runner


def one_device_buffer(staging) -> torch.Tensor:
    """Makes a CPU staging's views those of one buffer, as a GPU's are (its device buffer, which
    the staged graphs read and what runs on the device before them may change); returns it."""
    buffer = torch.zeros_like(staging.host[0])
    fill = staging.fill

    def filled(parts, offsets=(), first_view=0):
        views = fill(parts, offsets)   # every part's view: they locate the fill's one copy
        end = max((v.storage_offset() + len(v) for v in views), default=0)
        if views:   # the fill's one copy, whole
            buffer[:end] = views[0].as_strided((end,), (1,), 0)
        return [buffer[v.storage_offset():v.storage_offset() + len(v)] for v in views[first_view:]]
    staging.fill = filled
    return buffer


def graph_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The norm of the difference over the reference's, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_replay_is_eager(model, cache: torch.Tensor, replay, input_ids: torch.Tensor, positions: torch.Tensor,
                           meta, block_size: int, tolerance: float, what: str) -> None:
    """A graph's replay (`replay(input_ids, positions, meta)`) against the model run eagerly on a copy
    of the same KV cache: its output and the cache it leaves within `tolerance`, and exactly the step's
    slots written (a padding row or token stores nothing)."""
    snapshot = cache.clone()
    with torch.inference_mode():
        eager = model(input_ids, positions, meta)
    eager_cache = cache.clone()
    cache.copy_(snapshot)
    with torch.inference_mode():
        replayed = replay(input_ids, positions, meta).clone()
    assert replayed.shape == eager.shape, what
    err = graph_relative_error(replayed, eager)
    assert err < tolerance, f"{what}: relative error {err:.2e}"
    assert graph_relative_error(cache.float(), eager_cache.float()) < tolerance, f"{what}: KV cache differs"
    changed = (cache.view(torch.uint8) != snapshot.view(torch.uint8)).view(*cache.shape[:4], -1).any(-1)
    written = changed.nonzero()[:, 2:].unique(dim=0).tolist()
    expected = sorted({(s // block_size, s % block_size) for s in meta.slot_mapping.tolist()})
    assert sorted(map(tuple, written)) == expected, f"{what}: padding wrote K/V"


def tiny_model_with_random_cache(model_dir, backend, dtype: torch.dtype, device, max_model_len: int, num_blocks: int,
                                 block_size: int, kv_cache_dtype: torch.dtype | None = None):
    """(model, config, cache): the checkpoint's Qwen3ForCausalLM in `dtype` on `device` over `backend`, its KV
    cache (in kv_cache_dtype, default the model's) filled with random values, for the graphs' tests."""
    from transformers import AutoConfig

    from worker_svc import kv_cache
    from worker_svc.kv_cache_scales import bind_kv_scales
    from worker_svc.loader import load_safetensors
    from worker_svc.models.qwen3 import Qwen3ForCausalLM, head_dim_of

    config = AutoConfig.from_pretrained(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config, backend, max_model_len).eval()
    finally:
        torch.set_default_dtype(previous)
    load_safetensors(model, model_dir)
    cache = kv_cache.allocate_kv_cache(model, num_blocks, block_size, config.num_key_value_heads,
                                       head_dim_of(config), kv_cache_dtype or dtype, device)
    bind_kv_scales(model, cache.dtype, [])
    cache.copy_(torch.randn(cache.shape, device=device))   # rounded (or saturated, for FP8) to the cache's type
    return model, config, cache
