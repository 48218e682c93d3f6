"""ModelRunner driven step by step as the scheduler would: greedy generation equals
transformers' generate token for token through chunked prefill, prefix-cache hits, decodes and
growing block tables; seeded sampling survives preemption; bad steps are refused untouched; with
the torch sampler and with the device sampler's kernels. (Grammars, which start compiling
processes: tests/e2e/test_runner_grammar_e2e.py.)"""
from __future__ import annotations

import pytest
import torch

from common.pb.llm.worker.v1 import worker_pb2 as pb
from tests.support.hf_reference import hf_greedy, hf_model
from tests.support.runner_driver import (
    GREEDY,
    SAMPLERS,
    Driver,
    make_runner,
    prompt,
    skip_long_interpreted,
    step_request,
)
from tests.support.triton_interpreter import gpu_faithful
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import InvalidStepError, ModelRunner, StaleMirrorError
from worker_svc.step_message import parse_step_request


@pytest.fixture(params=SAMPLERS)
def sampler(request):
    """The torch sampler, or the device sampler's kernels sampling eagerly (interpreted on the CPU;
    on a GPU, tests/unit/test_gpu_pipelined_runner.py runs them inside the decode graphs)."""
    with gpu_faithful():
        yield request.param


def test_greedy_generation_equals_transformers(tiny_model_dir, sampler):
    d = Driver(make_runner(tiny_model_dir, sampler=sampler))
    a, b = prompt(1, 37), prompt(2, 11)
    c = a[:32] + prompt(3, 6)       # shares a's first two full blocks: a prefix-cache hit
    num_new = 10

    # Step 1: a's first chunk (mid-prompt: samples nothing) with b's whole prompt.
    assert set(d.step(new=[d.new(1, a, 20), d.new(2, b, 11)])) == {2}
    # Step 2: the rest of a's prompt over its cached chunk, b decodes.
    assert set(d.step(cached=[d.cached(1, 17), d.cached(2)])) == {1, 2}
    # Step 3: c arrives with 32 tokens already cached (a's blocks), a and b decode.
    sampled = d.step(new=[d.new(3, c, 6, cached_prefix_blocks=d.blocks[1][:2])], cached=[d.cached(1), d.cached(2)])
    assert set(sampled) == {1, 2, 3}
    for _ in range(num_new - 1):
        d.step(cached=[d.cached(s) for s in (1, 2, 3)])
    for seq_id, p in [(1, a), (2, b), (3, c)]:
        assert d.tokens[seq_id][len(p):][:num_new] == hf_greedy(tiny_model_dir, p, num_new), f"sequence {seq_id}"
    assert len(d.blocks[2]) == 2   # b grew into a second block while decoding
    # Nothing here asked for a grammar or extra logprobs: none of that machinery ran.
    assert d.runner.structured.pool.started == 0 and not d.runner.structured.masked
    assert all(o.top_logprobs is None and o.prompt_logprobs is None and o.logprobs is None for o in d.outputs)


def test_repetition_penalty_equals_transformers(tiny_model_dir):
    d = Driver(make_runner(tiny_model_dir))
    p = prompt(4, 9)
    options = pb.SamplingOptions(temperature=0.0, repetition_penalty=1.8)
    d.step(new=[d.new(1, p, 9, options)])
    for _ in range(11):
        d.step(cached=[d.cached(1)])
    ids = torch.tensor([p])
    with torch.inference_mode():
        expected = hf_model(tiny_model_dir).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, repetition_penalty=1.8,
            max_new_tokens=12, min_new_tokens=12, pad_token_id=0)[0, 9:].tolist()
    assert d.tokens[1][9:] == expected


def test_seeded_sampling_survives_preemption_and_batch_changes(tiny_model_dir, sampler):
    skip_long_interpreted(sampler)
    options = pb.SamplingOptions(temperature=1.0, top_k=40, seed=1234, frequency_penalty=0.5, logprobs=True)
    p = prompt(5, 21)

    alone = Driver(make_runner(tiny_model_dir, seed=1, sampler=sampler))
    alone.step(new=[alone.new(7, p, 21, options)])
    for _ in range(9):
        alone.step(cached=[alone.cached(7)])
    reference = alone.tokens[7][21:]

    d = Driver(make_runner(tiny_model_dir, seed=2, sampler=sampler))
    d.step(new=[d.new(7, p, 21, options), d.new(8, prompt(6, 5), 5, pb.SamplingOptions(temperature=1.0))])
    for _ in range(3):
        d.step(cached=[d.cached(7), d.cached(8)])
    # Preempted: the worker drops it; later it comes back with its outputs, recomputed in two chunks.
    so_far = d.tokens[7]
    d.forget(7)
    d.step(cached=[d.cached(8)], finished=[7])
    assert 7 not in d.runner.batch
    d.step(new=[d.new(7, so_far, 16, options, num_prompt=21)], cached=[d.cached(8)])
    d.step(cached=[d.cached(7, len(so_far) - 16), d.cached(8)])
    while len(d.tokens[7]) < 31:
        d.step(cached=[d.cached(7)])
    assert d.tokens[7][21:] == reference


def test_logprobs_are_returned_when_asked(tiny_model_dir, sampler):
    runner = make_runner(tiny_model_dir, sampler=sampler)
    d = Driver(runner)
    p = prompt(8, 12)
    d.step(new=[d.new(1, p, 12, pb.SamplingOptions(temperature=0.0, logprobs=True))])
    output = runner.step(parse_step_request(step_request(99, cached=[d.cached(1)])))
    with torch.inference_mode():
        logits = hf_model(tiny_model_dir)(torch.tensor([d.tokens[1]])).logits[0, -1]
    assert output.token_ids == [int(logits.argmax())]
    assert output.logprobs == pytest.approx([float(logits.log_softmax(-1).max())], abs=1e-4)
    assert output.total_ms >= output.forward_ms > 0


def test_bad_steps_are_refused_and_change_nothing(tiny_model_dir):
    runner = make_runner(tiny_model_dir)
    d = Driver(runner)
    p = prompt(9, 10)
    d.step(new=[d.new(1, p, 10)])
    d.step(cached=[d.cached(1)])           # one sampled token, known only on the device
    row = runner.batch.row_of[1]

    def state():
        b = runner.batch
        return (b.num_tokens[row], b.num_host_tokens[row], b.num_computed[row], b.num_blocks[row],
                list(b.block_tables[row]), len(b))

    before = state()

    def refused(error, match, new=(), cached=(), finished=()):
        with pytest.raises(error, match=match):
            runner.step(parse_step_request(step_request(50, new, cached, finished)))

    fresh = pb.NewRequest(seq_id=2, token_ids=[5, 6, 7], num_prompt_tokens=3, num_scheduled_tokens=3,
                          block_ids=[60], sampling=GREEDY)
    refused(StaleMirrorError, "not running", new=[fresh], cached=[(42, 1, [])])
    refused(StaleMirrorError, "already running", new=[pb.NewRequest(seq_id=1, token_ids=[5], num_prompt_tokens=1, num_scheduled_tokens=1, block_ids=[61])])
    refused(StaleMirrorError, "finished in the same step", cached=[(1, 1, [])], finished=[1])
    refused(InvalidStepError, "past the known tokens", cached=[(1, 2, [])])
    refused(InvalidStepError, "out of range", cached=[(1, 1, [64])])
    refused(InvalidStepError, "cannot hold", new=[pb.NewRequest(seq_id=3, token_ids=list(range(20)), num_prompt_tokens=20, num_scheduled_tokens=20, block_ids=[62])])
    refused(InvalidStepError, "vocab_size", new=[pb.NewRequest(seq_id=3, token_ids=[512], num_prompt_tokens=1, num_scheduled_tokens=1, block_ids=[62])])
    refused(InvalidStepError, "top_p", new=[pb.NewRequest(seq_id=3, token_ids=[5], num_prompt_tokens=1, num_scheduled_tokens=1, block_ids=[62], sampling=pb.SamplingOptions(top_p=2))])
    refused(InvalidStepError, "listed twice", cached=[(1, 1, [])] * 2)
    refused(InvalidStepError, "num_scheduled_tokens is 0", new=[pb.NewRequest(seq_id=3, token_ids=[5], num_prompt_tokens=1, block_ids=[62])])
    with pytest.raises(InvalidStepError, match="at least 2"):
        parse_step_request(pb.StepRequest(step_id=51, cached=pb.CachedRequests(
            seq_ids=[1], multi_token_indices=[0], multi_token_counts=[1])))
    with pytest.raises(InvalidStepError, match="ascend"):
        parse_step_request(pb.StepRequest(step_id=51, cached=pb.CachedRequests(
            seq_ids=[1], new_block_indices=[3], new_block_counts=[1], new_block_ids=[5])))
    with pytest.raises(InvalidStepError, match="add up"):
        parse_step_request(pb.StepRequest(step_id=51, cached=pb.CachedRequests(
            seq_ids=[1], new_block_indices=[0], new_block_counts=[2], new_block_ids=[5])))
    assert 2 not in runner.batch and 3 not in runner.batch
    assert state() == before
    d.step(cached=[d.cached(1)])     # and the request carries on
    assert d.tokens[1][10:] == hf_greedy(tiny_model_dir, p, 3)


def test_only_the_newest_sampled_token_can_be_computed(tiny_model_dir):
    """Sampled tokens live on the device, the newest per request: a step that would compute an
    older one (which only a NewRequest with every token can supply) is refused."""
    runner = make_runner(tiny_model_dir)
    d = Driver(runner)
    d.step(new=[d.new(1, prompt(12, 5), 5)])
    d.step(cached=[d.cached(1)])
    d.step(cached=[d.cached(1)])                     # 7 tokens known, 7 computed, 2 only on the device
    runner.batch.num_computed[runner.batch.row_of[1]] = 5   # as if the scheduler had lost two steps
    with pytest.raises(InvalidStepError, match="older than the newest"):
        runner.step(parse_step_request(step_request(60, cached=[(1, 2, [])])))


def test_describe_reset_and_cache_sizing(tiny_model_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_model_dir), max_model_len=100_000))
    info = runner.describe()
    assert (info.model, info.vocab_size, info.max_model_len, info.block_size) == ("tiny-qwen3", 512, 4096, 16)
    assert (info.device, info.attention_backend, info.dtype, info.world_size) == ("cpu", "torch", "float32", 1)
    assert info.num_kv_blocks == 4096   # the capped CPU default: 1 GiB would be 65536 tiny blocks
    assert info.instance_id and info.instance_id != make_runner(tiny_model_dir).describe().instance_id
    sized = make_runner(tiny_model_dir, num_kv_blocks=None, kv_cache_memory_gb=1 / 1024, max_model_len=256)
    # 1 MiB / (2 * 2 layers * 16 tokens * 2 kv heads * 32 dims * 4 bytes)
    assert (sized.num_kv_blocks, sized.max_model_len) == (64, 256)

    d = Driver(runner)
    d.step(new=[d.new(1, prompt(10, 5), 5), d.new(2, prompt(11, 7), 7)])
    runner.reset()
    assert len(runner.batch) == 0
    with pytest.raises(StaleMirrorError):
        runner.step(parse_step_request(step_request(1, cached=[(1, 1, [])])))


def test_the_requests_it_says_it_holds_fit_what_its_graphs_read(tiny_model_dir, sampler):
    """WorkerInfo.max_held_requests: that many requests at once (running, and paused ones that keep
    their mirrors) fit the per-row tensors the decode graphs read (last_sampled, the device
    sampler's table), so holding them never reallocates those (which turns the graphs off)."""
    runner = make_runner(tiny_model_dir, max_num_seqs=2, sampler=sampler)
    assert runner.describe().max_held_requests == 4
    read_by_graphs = runner.last_sampled
    d = Driver(runner)
    d.step(new=[d.new(1, prompt(1, 3), 3), d.new(2, prompt(2, 3), 3)])
    d.step(new=[d.new(3, prompt(3, 3), 3), d.new(4, prompt(4, 3), 3)])   # 1 and 2 paused: 4 held
    assert len(runner.batch) == 4 and runner.last_sampled is read_by_graphs
    d.step(new=[d.new(5, prompt(5, 3), 3)])                                 # past what it said
    assert len(runner.batch) == 5 and runner.last_sampled is not read_by_graphs


@torch.inference_mode()
def hf_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at every position of token_ids."""
    return hf_model(model_dir)(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def test_top_and_prompt_logprobs_equal_transformers_through_chunked_prefill(tiny_model_dir):
    runner = make_runner(tiny_model_dir)
    d = Driver(runner)
    p = prompt(10, 40)
    options = pb.SamplingOptions(temperature=0.8, seed=3, top_logprobs=5, prompt_logprobs=True)
    d.step(new=[d.new(1, p, 17, options), d.new(2, prompt(11, 5), 5)])   # a neighbour that asks nothing
    d.step(cached=[d.cached(1, 23), d.cached(2)])
    for _ in range(4):
        d.step(cached=[d.cached(1), d.cached(2)])
    reference = hf_logprobs(tiny_model_dir, d.tokens[1])

    scores, tops, firsts = [], [], []
    for output in d.outputs:
        if output.prompt_logprobs is not None:
            scored = output.prompt_logprobs
            assert scored.seq_ids == [1]
            firsts += scored.first_positions
            scores += scored.logprobs
            tops += split_top(scored.top)
    assert firsts == [1, 18] and len(scores) == len(p) - 1    # chunks of 17 and 23 positions
    expected = reference[:len(p) - 1].gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
    assert scores == pytest.approx(expected.tolist(), abs=1e-4)
    check_top(tops, reference[:len(p) - 1], 5)

    sampled_tops = []
    for output in d.outputs[1:]:
        top = split_top(output.top_logprobs)
        assert [len(ids) for ids, _ in top] == [5, 0] if len(top) == 2 else [5]   # the neighbour asked none
        sampled_tops.append(top[0])
    check_top(sampled_tops, reference[len(p) - 1:-1], 5)
    outputs = d.tokens[1][len(p):]
    lp = [d.outputs[i + 1].logprobs[0] for i in range(len(outputs))]
    assert lp == pytest.approx([reference[len(p) - 1 + i, t].item() for i, t in enumerate(outputs)], abs=1e-4)


def split_top(top) -> list[tuple[list[int], list[float]]]:
    out, offset = [], 0
    for count in top.counts:
        out.append((top.token_ids[offset:offset + count], top.logprobs[offset:offset + count]))
        offset += count
    return out


def check_top(tops, reference: torch.Tensor, k: int) -> None:
    assert len(tops) == len(reference)
    values, ids = reference.topk(k, dim=-1)
    for (got_ids, got_values), want_ids, want_values in zip(tops, ids.tolist(), values.tolist()):
        assert got_ids == want_ids
        assert got_values == pytest.approx(want_values, abs=1e-4)


