"""Captured decode graphs replay the eager forward: the project's Qwen3 model with each
graph-capable backend (Triton, FlashAttention-4) on the tiny checkpoint, at block sizes 16 and
128, random paged decode batches of sizes that hit and miss the captured sizes, against the same
model run eagerly on a copy of the same KV cache. A backend that cannot run here is skipped.
On the CPU (graph captures that run their body once, replays that run nothing): capturing the
sampling graphs again leaves every row of the staged step as it was; graphs whose replays run their
body again replay a forward's aux outputs (eagle3's) as the eager forward computes them."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.support.triton_interpreter import gpu_faithful
from worker_svc.cuda_graphs import MAX_GRAPH_BATCH_SIZE, DecodeGraphs, graph_batch_sizes
from worker_svc.graph_inputs import DecodeInputs, DecodeLayout
from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.layers.sampler import SamplingOptions
from tests.support.graph_stand_ins import (ReplayingGraph, assert_replay_is_eager, capture_on_the_cpu, cpu_only,
                                          graph_relative_error as relative_error, tiny_model_with_random_cache)
from tests.support.markers import requires_cuda

MAX_BATCH = 20
MAX_MODEL_LEN = 512

cuda = requires_cuda


def test_the_graphs_hold_a_verifying_step_of_the_speculative_batch():
    """A verifying step lays each of its 1 + K tokens per request out as a decode row: with fewer
    graph rows than that, it would run eagerly (v21: 22.6 ms a step instead of 7.1 at max_num_seqs 1)."""
    from worker_svc.startup import decode_graph_tokens

    assert decode_graph_tokens(256, 0, 16) == 256
    assert decode_graph_tokens(256, 4, 16) == 256          # 16 x 5 = 80 fit already
    assert decode_graph_tokens(8, 4, 16) == 40             # 8 requests at most, 5 tokens each
    assert decode_graph_tokens(64, 7, 16) == 128
    assert decode_graph_tokens(1, 4, 16) == 5


def test_graph_batch_sizes_cover_every_batch():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(4096)[-1] == MAX_GRAPH_BATCH_SIZE
    for cap in (1, 7, 16, 33, 300):
        sizes = graph_batch_sizes(cap)
        assert sizes == sorted(set(sizes)) and sizes[-1] == cap


def decode_batch(rng: random.Random, n: int, num_blocks: int, block_size: int, vocab: int, device) -> tuple:
    """n requests with random context lengths, each owning distinct random blocks."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    seq_lens = [rng.randint(1, MAX_MODEL_LEN) for _ in range(n)]
    width = max(-(-s // block_size) for s in seq_lens)
    tables = torch.zeros(n, width, dtype=torch.int32)
    slots = []
    for r, s in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(-(-s // block_size))]
        tables[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots.append(blocks[(s - 1) // block_size] * block_size + (s - 1) % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), max_query_len=1, max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * n, seq_lens_cpu=seq_lens)
    input_ids = torch.tensor([rng.randrange(vocab) for _ in range(n)], device=device)
    positions = torch.tensor([s - 1 for s in seq_lens], device=device)
    return input_ids, positions, meta


# FlashAttention-4 has no float32 kernels and reads no FP8 cache.
GRAPH_CASES = [pytest.param(backend, dtype, tolerance, block_size, None, id=f"{backend}-{label}-block{block_size}")
               for backend in ("triton", "flash_attn")
               for dtype, tolerance, label in ((torch.float32, 1e-5, "fp32"), (torch.bfloat16, 2e-2, "bf16"))
               for block_size in (16, 128)
               if not (backend == "flash_attn" and dtype == torch.float32)]
GRAPH_CASES += [pytest.param("triton", torch.bfloat16, 2e-2, block_size, torch.float8_e4m3fn,
                             id=f"triton-bf16-fp8kv-block{block_size}") for block_size in (16, 128)]


@cuda
@pytest.mark.parametrize("backend_name,dtype,tolerance,block_size,kv_cache_dtype", GRAPH_CASES)
def test_decode_graphs_replay_the_eager_forward(tiny_model_dir, backend_name, dtype, tolerance, block_size,
                                                kv_cache_dtype):
    from worker_svc.layers.attention.registry import describe_error, load_backend

    try:
        backend = load_backend(backend_name)
    except Exception as exc:  # not installed, or a GPU it does not support
        pytest.skip(f"{backend_name} cannot run here: {describe_error(exc)}")
    device = torch.device("cuda")
    num_blocks = MAX_BATCH * MAX_MODEL_LEN // block_size
    model, config, cache = tiny_model_with_random_cache(tiny_model_dir, backend, dtype, device, MAX_MODEL_LEN,
                                                        num_blocks, block_size, kv_cache_dtype)
    before_capture = cache.clone()
    graphs = DecodeGraphs(model, max_batch_size=MAX_BATCH, max_blocks_per_seq=MAX_MODEL_LEN // block_size,
                          max_model_len=MAX_MODEL_LEN, device=device)
    assert torch.equal(cache.view(torch.uint8), before_capture.view(torch.uint8)), "capture wrote into the KV cache"

    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    for n in (1, 3, 8, 17, MAX_BATCH, 5):  # captured sizes, padded ones, and shrinking again
        input_ids, positions, meta = decode_batch(rng, n, num_blocks, block_size, config.vocab_size, device)
        assert graphs.can_run(meta)
        assert_replay_is_eager(model, cache, graphs.run, input_ids, positions, meta, block_size, tolerance,
                               f"seed {seed}, batch {n}")

    # eagle3's graphs: the same forward also returning the hidden states entering layers 0 and 1.
    aux_layers = (0, min(1, config.num_hidden_layers - 1))
    aux_graphs = DecodeGraphs(lambda ids, pos, m: model(ids, pos, m, aux_layers), max_batch_size=MAX_BATCH,
                              max_blocks_per_seq=MAX_MODEL_LEN // block_size, max_model_len=MAX_MODEL_LEN,
                              device=device)
    for n in (3, 8):
        input_ids, positions, meta = decode_batch(rng, n, num_blocks, block_size, config.vocab_size, device)
        with torch.inference_mode():
            eager, eager_aux = model(input_ids, positions, meta, aux_layers)
            replayed = aux_graphs.run(input_ids, positions, meta).clone()
            replayed_aux = [a.clone() for a in aux_graphs.aux(n)]
        assert relative_error(replayed, eager) < tolerance, f"seed {seed}, batch {n}"
        for got, want in zip(replayed_aux, eager_aux, strict=True):
            assert relative_error(got, want) < tolerance, f"seed {seed}, batch {n}: aux hidden states differ"

    mixed = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                              max_query_len=2, max_seq_len=meta.max_seq_len,
                              query_lens_cpu=meta.query_lens_cpu, seq_lens_cpu=meta.seq_lens_cpu)
    assert not graphs.can_run(mixed)


# The CPU stand-ins run Triton's kernels on CPU tensors, which only its interpreter does (a machine
# with a GPU compiles them for the device): there, test_decode_graphs_replay_the_eager_forward and
# tests/unit/test_gpu_pipelined_runner.py check the same with real graphs.


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    """torch.cuda's graph calls as UnreplayedGraph, so DecodeGraphs captures on the CPU."""
    capture_on_the_cpu(monkeypatch)
    with gpu_faithful():
        yield


@cpu_only
def test_capturing_the_sampling_again_draws_for_no_row_of_the_step(graphs_on_the_cpu):
    from worker_svc.layers.device_sampler import DeviceSampler

    vocab, max_batch = 32, 4     # two chunks a row; graphs of 1, 2 and 4 rows (the step's 3 padded to 4)
    cpu = torch.device("cpu")
    sampler = DeviceSampler(vocab, cpu, capacity=max_batch, max_rows=max_batch, chunk=16, gather_cap=8)
    last_sampled = torch.full((sampler.capacity + 1,), -1, dtype=torch.int64)
    layout = DecodeLayout(max_batch)
    staged = torch.zeros(layout.offsets(max_batch, 4)[-1], dtype=torch.int64)
    inputs = DecodeInputs(staged, layout, last_sampled, sampler.dummy_row)
    weights = torch.randn(vocab, vocab)
    graphs = DecodeGraphs(lambda ids, positions, meta: weights[ids], max_batch_size=max_batch,
                          max_blocks_per_seq=4, max_model_len=64, device=cpu, inputs=inputs,
                          sample=lambda *args: sampler.sample(*args, last_sampled), sample_key=sampler.graph_key)
    # Graphs that unpack staged columns take no copied-in inputs: a decode step not staged runs eagerly.
    assert not graphs.can_run(graphs.staged_meta(np.array([5, 6, 7]), 64))
    # Requests with penalties admitted after start-up grow the sampler's tensors: the next
    # sampling replay captures its graphs again.
    for row in range(3):
        options = SamplingOptions(temperature=0.8, top_p=0.9, seed=11 + row, presence_penalty=0.5)
        sampler.add(row, list(range(5)), 5, options)
    sampler.flush()
    assert sampler.graph_key() != graphs._sampled_key
    graphs.rows[:4] = torch.tensor([0, 1, 2, sampler.dummy_row])   # the step's rows, as its forward unpacked them
    counters, counts = sampler.counters.clone(), sampler.penalties.output_counts.clone()

    graphs.replay_sample(3)

    assert graphs._sampled_key == sampler.graph_key()
    assert torch.equal(sampler.counters[:3], counters[:3]), "a warm-up advanced a row's draw counter"
    assert torch.equal(sampler.penalties.output_counts, counts), "a warm-up counted a token into a row's penalties"
    assert torch.equal(last_sampled[:3], torch.full((3,), -1)), "a warm-up stored a row's newest token"
    assert graphs.rows[:4].tolist() == [0, 1, 2, sampler.dummy_row]


@cpu_only
def test_graphs_of_a_forward_with_aux_outputs_replay_them_as_the_eager_forward(tiny_model_dir, graphs_on_the_cpu,
                                                                                monkeypatch):
    """eagle3 reads the hidden states entering some layers: the decode graphs of a forward that
    returns them replay them, beside the final hidden states, as the eager forward computes them
    (on the CPU: graphs whose replay runs their captured body, the tiny model, Triton's attention
    interpreted; every batch size, padded or not)."""
    import functools

    from transformers import AutoConfig

    from worker_svc import kv_cache
    from worker_svc.kv_cache_scales import bind_kv_scales
    from worker_svc.layers.attention.registry import load_backend
    from worker_svc.loader import load_safetensors
    from worker_svc.models.qwen3 import Qwen3ForCausalLM, head_dim_of

    monkeypatch.setattr(torch.cuda, "CUDAGraph", ReplayingGraph)
    cpu, block_size, max_batch, max_len, aux_layers = torch.device("cpu"), 16, 4, 32, (0, 1)   # 2 blocks a row
    config = AutoConfig.from_pretrained(tiny_model_dir)
    model = Qwen3ForCausalLM(config, load_backend("triton"), max_len).eval()
    load_safetensors(model, tiny_model_dir)
    num_blocks = max_batch * max_len // block_size
    cache = kv_cache.allocate_kv_cache(model, num_blocks, block_size, config.num_key_value_heads,
                                       head_dim_of(config), torch.float32, cpu)
    bind_kv_scales(model, cache.dtype, [])
    cache.copy_(torch.randn(cache.shape))
    graphs = DecodeGraphs(lambda ids, positions, meta: model(ids, positions, meta, aux_layers),
                          max_batch_size=max_batch, max_blocks_per_seq=max_len // block_size, max_model_len=max_len,
                          device=cpu)
    for size, graph in graphs.graphs.items():
        graph.body = functools.partial(graphs._captured, size)
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    for n in (3, 1):    # padded to 4, then a captured size
        seq_lens = [rng.randint(1, max_len) for _ in range(n)]
        tables = torch.tensor([rng.sample(range(num_blocks), max_len // block_size) for _ in range(n)],
                              dtype=torch.int32)
        slots = [int(tables[r, (s - 1) // block_size]) * block_size + (s - 1) % block_size
                 for r, s in enumerate(seq_lens)]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                                 max_query_len=1, max_seq_len=max(seq_lens), query_lens_cpu=[1] * n,
                                 seq_lens_cpu=seq_lens)
        ids, positions = torch.tensor([rng.randrange(config.vocab_size) for _ in range(n)]), torch.tensor(seq_lens) - 1
        with torch.inference_mode():
            eager, eager_aux = model(ids, positions, meta, aux_layers)
            replayed = graphs.run(ids, positions, meta).clone()
            replayed_aux = [a.clone() for a in graphs.aux(n)]
        assert replayed.shape == eager.shape and len(replayed_aux) == len(aux_layers)
        assert relative_error(replayed, eager) < 1e-5, f"seed {seed}, batch {n}"
        for got, want in zip(replayed_aux, eager_aux):
            assert got.shape == want.shape and relative_error(got, want) < 1e-5, f"seed {seed}, batch {n}"
