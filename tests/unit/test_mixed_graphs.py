"""CUDA graphs of the steps that are not pure decode (worker_svc/mixed_graphs.py) replay the eager
forward: the tiny model over Triton's attention, random batches of prefill chunks beside decodes
whose token counts hit and miss the captured sizes, against the same model run eagerly on a copy of
the same KV cache; the padding tokens store nothing. On a GPU with real graphs; on the CPU with
graphs whose replay runs their captured body, Triton's kernels interpreted. And a runner that
replays them gives the tokens of one that does not, through chunked prefills and decodes, with the
prompt's logprobs, top logprobs and seeded draws too."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from tests.support.graph_stand_ins import (ReplayingGraph, assert_replay_is_eager, capture_on_the_cpu,
                                          tiny_model_with_random_cache)
from tests.support.markers import HAS_CUDA
from tests.support.triton_interpreter import gpu_faithful
from tests.support.worker_batches import metadata_on, paged_metadata, positions_of, random_block_tables
from worker_svc.layers.attention.base import AttentionMetadata
from worker_svc.mixed_graphs import MixedGraphs, token_buckets

MAX_TOKENS, MAX_REQUESTS, MAX_MODEL_LEN = 48, 6, 128


def test_token_buckets_cover_every_step():
    sizes = token_buckets(16384)
    assert sizes[:4] == [16, 32, 64, 128]
    assert sizes[sizes.index(2048):] == list(range(2048, 16385, 2048))   # at most 2,048 padding tokens past 2,048
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(3000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    for cap in (2, 16, 17, 2048, 2049, 5000):
        sizes = token_buckets(cap)
        assert sizes == sorted(set(sizes)) and sizes[-1] == cap


@pytest.fixture
def device(monkeypatch):
    """cuda with real graphs, or the CPU with graphs that replay their body (Triton interpreted)."""
    if HAS_CUDA:
        yield torch.device("cuda")
        return
    capture_on_the_cpu(monkeypatch, ReplayingGraph)
    with gpu_faithful():
        yield torch.device("cpu")


def replaying(graphs: MixedGraphs) -> MixedGraphs:
    """On the CPU, each stand-in graph replays its body (what its capture ran)."""
    for size, graph in graphs.graphs.items():
        if isinstance(graph, ReplayingGraph):
            graph.body = functools.partial(graphs._captured, size)
    return graphs


def mixed_batch(rng: random.Random, query_lens: list[int], num_blocks: int, block_size: int, vocab: int,
                device) -> tuple:
    """Requests computing query_lens[i] tokens at the end of a random context, each on its own random blocks."""
    seq_lens = [q + rng.randint(0, MAX_MODEL_LEN - q) for q in query_lens]
    tables = random_block_tables(seq_lens, block_size, num_blocks, torch.Generator().manual_seed(rng.randrange(2**31)))
    meta = metadata_on(paged_metadata(tables, seq_lens, query_lens, block_size), device)
    input_ids = torch.tensor([rng.randrange(vocab) for _ in range(sum(query_lens))], device=device)
    return input_ids, positions_of(seq_lens, query_lens).to(device), meta


ON_THE_GPU = pytest.mark.skipif(not HAS_CUDA, reason="on the GPU; float32 covers the CPU")


@pytest.mark.parametrize("dtype,tolerance,kv_cache_dtype", [
    pytest.param(torch.float32, 1e-5, None, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, None, id="bf16", marks=ON_THE_GPU),
    pytest.param(torch.bfloat16, 2e-2, torch.float8_e4m3fn, id="bf16-fp8kv", marks=ON_THE_GPU)])
def test_mixed_graphs_replay_the_eager_forward(tiny_model_dir, device, dtype, tolerance, kv_cache_dtype):
    from worker_svc.layers.attention.registry import load_backend

    block_size = 16
    num_blocks = MAX_REQUESTS * MAX_MODEL_LEN // block_size
    model, config, cache = tiny_model_with_random_cache(tiny_model_dir, load_backend("triton"), dtype, device,
                                                        MAX_MODEL_LEN, num_blocks, block_size, kv_cache_dtype)
    before_capture = cache.clone()
    graphs = replaying(MixedGraphs(model, max_tokens=MAX_TOKENS, max_requests=MAX_REQUESTS,
                                   max_blocks_per_seq=MAX_MODEL_LEN // block_size, max_model_len=MAX_MODEL_LEN,
                                   device=device))
    assert graphs.sizes == [16, 32, 48]
    assert torch.equal(cache.view(torch.uint8), before_capture.view(torch.uint8)), "capture wrote into the KV cache"

    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    # A captured size alone and beside decodes, padded ones (a lone prompt; a chunk with a decode),
    # the most requests, the largest size, and shrinking again.
    for query_lens in ([16], [5, 1, 1, 9], [7], [20, 1], [3, 1, 1, 1, 1, 2], [30, 1, 17], [2, 1]):
        input_ids, positions, meta = mixed_batch(rng, query_lens, num_blocks, block_size, config.vocab_size, device)
        assert graphs.can_run(meta)
        assert_replay_is_eager(model, cache, graphs.run, input_ids, positions, meta, block_size, tolerance,
                               f"seed {seed}, queries {query_lens}")
    assert graphs.replays == 7

    decode = AttentionMetadata(meta.slot_mapping[:2], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               max_query_len=1, max_seq_len=meta.max_seq_len, query_lens_cpu=[1, 1],
                               seq_lens_cpu=meta.seq_lens_cpu)
    assert not graphs.can_run(decode), "a pure decode is the decode graphs'"
    _, _, too_many = mixed_batch(rng, [30, 19], num_blocks, block_size, config.vocab_size, device)
    assert not graphs.can_run(too_many), "49 tokens, past the largest graph"


@pytest.mark.skipif(HAS_CUDA, reason="the CPU stand-in; the GPU's runner is tests/unit/test_gpu_pipelined_runner.py's")
def test_a_runner_replaying_mixed_graphs_samples_the_tokens_of_one_that_does_not(tiny_model_dir, monkeypatch):
    """Chunked prefills beside decodes, greedy, float32: token for token (graphs whose replay runs
    their body, over the attention that reads every length from the device)."""
    from tests.support.graph_stand_ins import replaying_graphs_on_the_cpu
    from tests.support.runner_driver import Driver, make_runner, prompt

    replaying_graphs_on_the_cpu(monkeypatch)

    def run(graphed: bool) -> tuple[list[dict[int, int]], int]:
        runner = make_runner(tiny_model_dir, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=128)
        if graphed:
            runner.mixed_graphs = replaying(MixedGraphs(
                runner.model, max_tokens=32, max_requests=4, max_blocks_per_seq=runner.max_blocks_per_seq,
                max_model_len=runner.max_model_len, device=runner.device))
        driver = Driver(runner)
        steps = [driver.step(new=[driver.new(1, prompt(1, 40), 32)]),          # a chunk of a long prompt
                 driver.step(new=[driver.new(2, prompt(2, 9), 9)], cached=[driver.cached(1, 8)]),
                 driver.step(new=[driver.new(3, prompt(3, 20), 20)], cached=[driver.cached(1), driver.cached(2)])]
        for _ in range(4):
            steps.append(driver.step(cached=[driver.cached(s) for s in (1, 2, 3)]))
        return steps, runner.mixed_graphs.replays if graphed else 0

    eager, _ = run(False)
    replayed, replays = run(True)
    assert replayed == eager
    assert replays == 3, "the three steps with prompt tokens replay; the decodes do not"


def test_start_up_captures_mixed_graphs_only_where_they_hold(monkeypatch, caplog):
    """Off unless asked for; a backend without the support, a speculating worker, a tensor-parallel rank or
    an MoE model launches such steps eagerly and says why; so does one out of device memory at capture, one
    whose capture the driver refused, and one whose test step replays wrong."""
    import types

    from worker_svc import mixed_graphs, startup
    from worker_svc.layers.attention.torch_backend import TorchAttentionBackend
    from worker_svc.layers.attention.triton_backend import TritonAttentionBackend
    from worker_svc.layers.moe import FusedExperts

    def runner(backend=None, proposer=None, modules=(), tp_size=1):
        return types.SimpleNamespace(device=torch.device("cuda"), config=types.SimpleNamespace(
            enforce_eager=False, max_num_batched_tokens=64, max_num_seqs=4),
            backend=backend or TritonAttentionBackend(), proposer=proposer,
            model=types.SimpleNamespace(modules=lambda: iter(modules)), max_blocks_per_seq=8, max_model_len=128,
            block_size=16, vocab_size=512, num_kv_blocks=64, dtype=torch.bfloat16, tp_size=tp_size)

    monkeypatch.setattr(mixed_graphs, "ENABLED", False)
    assert startup.capture_mixed_graphs(runner()) is None
    monkeypatch.setattr(mixed_graphs, "ENABLED", True)
    caplog.set_level("INFO", logger=startup.logger.name)
    assert startup.capture_mixed_graphs(runner(backend=TorchAttentionBackend())) is None
    assert "attention backend torch reads host lengths" in caplog.text
    assert startup.capture_mixed_graphs(runner(proposer=object())) is None
    assert "speculating worker" in caplog.text
    assert startup.capture_mixed_graphs(runner(tp_size=2)) is None
    assert "tensor-parallel group" in caplog.text
    assert startup.capture_mixed_graphs(runner(modules=[torch.nn.Linear(2, 2), object.__new__(FusedExperts)])) is None
    assert "MoE model's router" in caplog.text

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(mixed_graphs, "MixedGraphs", out_of_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert startup.capture_mixed_graphs(runner()) is None
    assert "graphs are off, such steps launch eagerly: no device memory left for them" in caplog.text

    def refused(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(mixed_graphs, "MixedGraphs", refused)
    assert startup.capture_mixed_graphs(runner()) is None
    assert "their capture failed (RuntimeError('CUDA error: operation not permitted" in caplog.text
    captured = object()
    def captured_with(error):
        return lambda *a, **k: types.SimpleNamespace(graphs={16: captured}, sizes=[16, 64], max_requests=4,
                                                     replay_error=lambda *a: error)

    for error, kept in ((3e-3, True), (0.7, False), (float("nan"), False)):   # rounding; a wrong replay
        monkeypatch.setattr(mixed_graphs, "MixedGraphs", captured_with(error))
        graphs = startup.capture_mixed_graphs(runner())
        assert (graphs is not None and graphs.graphs == {16: captured}) == kept, error
    assert "replay a test step 7.00e-01 away from the eager forward" in caplog.text


def test_the_start_up_check_tells_a_right_replay_from_a_wrong_one(tiny_model_dir, device):
    """replay_error: rounding for graphs that replay the forward (one request a step, or two), ~1 for a
    replay that computes nothing."""
    from worker_svc.layers.attention.registry import load_backend

    model, config, _ = tiny_model_with_random_cache(tiny_model_dir, load_backend("triton"), torch.float32, device,
                                                    MAX_MODEL_LEN, 16, 4)
    for max_requests in (1, 4):
        graphs = replaying(MixedGraphs(model, max_tokens=32, max_requests=max_requests, max_blocks_per_seq=8,
                                       max_model_len=MAX_MODEL_LEN, device=device))
        assert graphs.replay_error(4, config.vocab_size) < 1e-5
        assert graphs.replays == 0
    graphs.run = lambda input_ids, positions, meta: torch.zeros_like(graphs.outputs[:len(input_ids)])
    assert graphs.replay_error(4, config.vocab_size) > 0.5, "a replay that computes nothing"


@pytest.mark.skipif(HAS_CUDA, reason="the CPU stand-in; the GPU's runner is tests/unit/test_gpu_pipelined_runner.py's")
def test_replayed_mixed_steps_keep_prompt_logprobs_top_logprobs_and_seeded_draws(tiny_model_dir, monkeypatch):
    """What reads the replayed forward's output besides the greedy token (its view of a static buffer): the
    prompt's scores over every prompt token of a chunk, the top logprobs, and a seeded temperature draw, in
    steps with prompt chunks beside decodes; against the same steps launched eagerly (float32)."""
    from common.pb.llm.worker.v1 import worker_pb2 as pb
    from tests.support.graph_stand_ins import replaying_graphs_on_the_cpu
    from tests.support.runner_driver import Driver, make_runner, prompt

    replaying_graphs_on_the_cpu(monkeypatch)
    scored = pb.SamplingOptions(temperature=0.0, logprobs=True, top_logprobs=3, prompt_logprobs=True)
    seeded = pb.SamplingOptions(temperature=0.8, seed=1234, logprobs=True)

    def run(graphed: bool):
        runner = make_runner(tiny_model_dir, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
                             max_model_len=128, sampler="torch")
        if graphed:
            runner.mixed_graphs = replaying(MixedGraphs(
                runner.model, max_tokens=32, max_requests=4, max_blocks_per_seq=runner.max_blocks_per_seq,
                max_model_len=runner.max_model_len, device=runner.device))
        driver = Driver(runner)
        driver.step(new=[driver.new(1, prompt(1, 30), 20, scored)])                      # a scored chunk
        driver.step(new=[driver.new(2, prompt(2, 12), 12, seeded)], cached=[driver.cached(1, 10)])
        for _ in range(3):
            driver.step(new=[driver.new(3, prompt(3, 5), 5)] if _ == 0 else (),
                        cached=[driver.cached(s) for s in (1, 2)] + ([driver.cached(3)] if _ else []))
        return driver.outputs, runner.mixed_graphs.replays if graphed else 0

    eager, _ = run(False)
    replayed, replays = run(True)
    assert replays == 3, "the steps with prompt tokens replay"
    for e, r in zip(eager, replayed):
        assert r.token_ids == e.token_ids, r.step_id
        assert r.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        assert (r.top_logprobs is None) == (e.top_logprobs is None)
        if e.top_logprobs is not None:
            assert r.top_logprobs.token_ids == e.top_logprobs.token_ids
            assert r.top_logprobs.logprobs == pytest.approx(e.top_logprobs.logprobs, abs=1e-4)
        assert (r.prompt_logprobs is None) == (e.prompt_logprobs is None)
        if e.prompt_logprobs is not None:
            assert (r.prompt_logprobs.seq_ids, r.prompt_logprobs.counts) == (e.prompt_logprobs.seq_ids,
                                                                            e.prompt_logprobs.counts)
            assert r.prompt_logprobs.logprobs == pytest.approx(e.prompt_logprobs.logprobs, abs=1e-4)
    assert sum(len(o.prompt_logprobs.logprobs) for o in eager if o.prompt_logprobs) == 29, "every prompt token but the first"
