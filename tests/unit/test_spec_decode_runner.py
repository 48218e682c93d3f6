"""ModelRunner with speculative decoding (ngram, eagle3, draft), driven as the scheduler would
drive it: every decode verifies all the drafts the worker holds for it. Greedy output equals
transformers' token for token, with each verified token laid out as a decode row or as one chunk;
seeded sampling with every option, and its logprobs, equal the plain runner's; a grammar holds over
accepted runs (tests/e2e/test_runner_grammar_e2e.py: it starts a compiling process); a draft model
that is the target has its drafts accepted; steps that ask for no drafts skip the proposer on the
device; steps that ask for drafts the worker does not hold are refused."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from common.pb.llm.worker.v1 import worker_pb2 as pb
from tests.support.hf_reference import hf_greedy
from tests.support.runner_driver import GREEDY, make_runner, prompt
from tests.support.speculative_loop import Loop, ngram_runner, repeating
from tests.support.triton_interpreter import INTERPRETED, gpu_faithful
from worker_svc.config import add_worker_arguments, worker_config_from_args
from worker_svc.model_runner import InvalidStepError, ModelRunner
from worker_svc.step_message import parse_step_request


# The runners here are on the CPU: --sampler kernels runs their kernels under Triton's interpreter.
interpreted_kernels = pytest.mark.skipif(not INTERPRETED, reason="CPU runners' kernels need Triton's interpreter")


@pytest.mark.parametrize("as_decodes", [True, False], ids=["decode-rows", "chunks"])
def test_greedy_with_ngram_drafts_equals_transformers(tiny_model_dir, as_decodes):
    requests = {1: (repeating(1, 7, 4), GREEDY), 2: (prompt(2, 9), GREEDY), 3: (repeating(3, 3, 5), GREEDY)}
    runner = ngram_runner(tiny_model_dir)
    runner.verify_as_decodes = as_decodes   # each verified token a decode row (the graphs' shape) or one chunk
    loop = Loop(runner)
    outputs = loop.run(requests, 30)
    for seq_id, (p, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 30), f"sequence {seq_id}"
    assert loop.num_verified > 10 and loop.num_accepted > 0
    assert loop.runner.describe().speculative_method == "ngram"


@pytest.mark.parametrize("method", ["eagle3", "draft"])
def test_greedy_with_drafts_of_a_model_on_the_device_equals_transformers(tiny_model_dir, tiny_eagle3_dir,
                                                                         tiny_draft_dir, method):
    head = tiny_eagle3_dir if method == "eagle3" else tiny_draft_dir
    runner = make_runner(tiny_model_dir, speculative_method=method, speculative_model=str(head),
                         num_speculative_tokens=3)
    requests = {1: (prompt(1, 40), GREEDY), 2: (prompt(2, 9), GREEDY), 3: (repeating(3, 3, 5), GREEDY)}
    loop = Loop(runner)
    outputs = loop.run(requests, 20)
    for seq_id, (p, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 20), f"sequence {seq_id}"
    assert loop.num_verified > 10 and runner.describe().speculative_method == method


def test_a_draft_model_that_is_the_target_has_its_greedy_drafts_accepted(tiny_model_dir, tiny_self_draft_dir):
    runner = make_runner(tiny_model_dir, speculative_method="draft", speculative_model=str(tiny_self_draft_dir),
                         num_speculative_tokens=3)
    requests = {1: (prompt(4, 30), GREEDY), 2: (prompt(5, 7), GREEDY)}
    loop = Loop(runner)
    outputs = loop.run(requests, 24)
    for seq_id, (p, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 24), f"sequence {seq_id}"
    assert loop.num_accepted >= 0.9 * 3 * loop.num_verified > 0



def test_steps_asking_for_no_drafts_skip_the_proposer_and_its_rows_draft_no_more(tiny_model_dir,
                                                                                 tiny_self_draft_dir):
    """Steps past the scheduler's batch threshold ask for no drafts: the proposer on the device
    does not run in them (they cost what they cost without speculation). A row it skipped gets no
    drafts afterwards (its cache lacks those positions); a row added later drafts, and its drafts
    (the target's own) are accepted. Greedy output stays transformers' throughout."""
    runner = make_runner(tiny_model_dir, speculative_method="draft", speculative_model=str(tiny_self_draft_dir),
                         num_speculative_tokens=3)
    catch_ups = []
    catch_up = runner.drafter.catch_up
    runner.drafter.catch_up = lambda *args: catch_ups.append(args) or catch_up(*args)
    loop = Loop(runner)
    loop.propose = False
    skipped, later = {1: (prompt(4, 30), GREEDY)}, {2: (prompt(5, 7), GREEDY)}
    loop.start(skipped)
    for _ in range(3):
        loop.decode()
    assert catch_ups == [] and loop.held[1] == 0
    loop.propose = True
    loop.start(later)
    while min(len(loop.tokens[s]) - len(p) for s, (p, _) in {**skipped, **later}.items()) < 24:
        loop.decode()
        assert loop.held[1] == 0, "a row the proposer skipped holds drafts"
    assert catch_ups and loop.num_accepted >= 0.9 * 3 * loop.num_verified > 0
    for seq_id, (p, _) in {**skipped, **later}.items():
        assert loop.tokens[seq_id][len(p):len(p) + 24] == hf_greedy(tiny_model_dir, p, 24), f"sequence {seq_id}"

def oracle(runner: ModelRunner, reference: dict[int, list[int]]):
    """A host proposer that knows each request's plain output: it proposes the next 4 tokens of
    it, the third of them wrong every other time (so runs are accepted whole and in part)."""
    b = runner.batch

    def propose(rows):
        proposals = []
        for row in rows.tolist():
            n = int(b.num_tokens[row])
            drafts = list(reference[int(b.seq_id_of[row])][n:n + 4])
            if n % 2 and len(drafts) > 2:
                drafts[2] = (drafts[2] + 1) % 500
            proposals.append(np.array(drafts, dtype=np.int64))
        return proposals
    return propose


@pytest.mark.parametrize("options", [
    pb.SamplingOptions(temperature=0.8, top_p=0.9, top_k=30, min_p=0.02, seed=7, repetition_penalty=1.2,
                       presence_penalty=0.3, frequency_penalty=0.2, logit_bias={5: 2.0, 9: -3.0}, logprobs=True,
                       top_logprobs=3),
    pb.SamplingOptions(temperature=0.0, repetition_penalty=1.3, logprobs=True, top_logprobs=3),
], ids=["seeded", "greedy-penalized"])
def test_sampling_with_drafts_equals_plain_sampling_with_its_logprobs(tiny_model_dir, options):
    requests = {1: (prompt(4, 9), options), 2: (repeating(5, 2, 8), options)}
    plain = Loop(make_runner(tiny_model_dir))
    expected = plain.run(requests, 25)
    speculative = Loop(ngram_runner(tiny_model_dir))
    speculative.runner.bookkeeping.propose_on_host = oracle(speculative.runner, plain.tokens)
    assert speculative.run(requests, 25) == expected
    assert speculative.num_accepted > 10 and plain.num_verified == 0
    for seq_id in requests:
        assert speculative.logprobs[seq_id][:25] == pytest.approx(plain.logprobs[seq_id][:25], abs=1e-4)
        assert speculative.tops[seq_id][:75] == plain.tops[seq_id][:75]


@interpreted_kernels
@pytest.mark.parametrize("options", [
    # (truncation draws the same way at every offset: the kernel tests cover it, here it is slow)
    pb.SamplingOptions(temperature=0.8, seed=7, logprobs=True, top_logprobs=3),
    pb.SamplingOptions(temperature=0.8, seed=8, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2,
                       logit_bias={5: 2.0, 9: -3.0}, logprobs=True),
    pb.SamplingOptions(temperature=1.0),   # unseeded: keyed by the worker's generator, in admission order
    pb.SamplingOptions(temperature=0.0),
], ids=["seeded", "seeded-penalized", "unseeded", "greedy"])
def test_the_device_sampler_verifies_drafts_drawing_the_tokens_it_draws_without_them(tiny_model_dir, options):
    """--sampler kernels with speculation: a verifying step's positions are drawn by the device
    sampler as each row draws that output index, the drafts before each counted for its penalties
    (DeviceSampler.sample_ahead; greedy rows by argmax), so the tokens and logprobs are the plain
    device sampler's whatever was accepted."""
    requests = {1: (prompt(4, 9), options), 2: (repeating(5, 2, 8), options)}
    with gpu_faithful():
        plain = Loop(make_runner(tiny_model_dir, sampler="kernels"))
        expected = plain.run(requests, 25)
        runner = ngram_runner(tiny_model_dir, sampler="kernels")
        speculative = Loop(runner)
        runner.bookkeeping.propose_on_host = oracle(runner, plain.tokens)
        assert speculative.run(requests, 25) == expected
    assert speculative.num_accepted > 10 and runner.sampler is None
    for seq_id in requests:
        assert speculative.logprobs[seq_id][:25] == pytest.approx(plain.logprobs[seq_id][:25], abs=1e-5)
        assert speculative.tops[seq_id][:75] == plain.tops[seq_id][:75]
    assert all(int(runner.device_sampler.counters[runner.batch.row_of[s]]) == len(speculative.tokens[s]) - len(p)
               for s, (p, _) in requests.items())


def test_a_step_asking_for_more_drafts_than_held_verifies_those_held(tiny_model_dir):
    """As a scheduler that schedules ahead asks: the most drafts the last step may have proposed;
    the worker verifies those it holds (none, for a request without a match) and says how many."""
    requests = {1: (repeating(8, 3, 6), GREEDY), 2: (prompt(9, 20), GREEDY)}
    loop = Loop(ngram_runner(tiny_model_dir))
    loop.ask = 4
    outputs = loop.run(requests, 20)
    assert loop.num_accepted > 5 and loop.num_fitted > 0
    for seq_id, (token_ids, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, token_ids, 20)


def test_steps_verifying_drafts_where_they_cannot_are_refused(tiny_model_dir):
    runner = ngram_runner(tiny_model_dir)
    loop = Loop(runner)
    loop.start({1: (repeating(8, 3, 6), GREEDY), 2: (prompt(9, 20), GREEDY)})
    while not loop.held[1]:
        loop.decode()
    # A request halfway through its prompt: nothing to verify drafts after.
    loop.step_id += 1
    half = pb.NewRequest(seq_id=3, token_ids=prompt(10, 20), num_prompt_tokens=20, num_scheduled_tokens=8,
                         block_ids=[loop.free_blocks.pop(), loop.free_blocks.pop()], sampling=GREEDY)
    runner.step(parse_step_request(pb.StepRequest(step_id=loop.step_id, new_requests=[half])))
    with pytest.raises(InvalidStepError, match="request 3: verifies drafts but does not decode its newest token"):
        runner.step(parse_step_request(pb.StepRequest(step_id=loop.step_id + 1, cached=pb.CachedRequests(
            seq_ids=[3], multi_token_indices=[0], multi_token_counts=[8], draft_indices=[0], draft_counts=[1]))))
    loop.step_id += 1
    runner.step(parse_step_request(pb.StepRequest(step_id=loop.step_id, finished_seq_ids=[3])))
    with pytest.raises(InvalidStepError, match="draft_counts must be positive"):
        parse_step_request(pb.StepRequest(step_id=9, cached=pb.CachedRequests(seq_ids=[1], draft_indices=[0],
                                                                             draft_counts=[0])))
    loop.decode()                                       # and both carry on
    assert loop.tokens[1][18:] == hf_greedy(tiny_model_dir, repeating(8, 3, 6), len(loop.tokens[1]) - 18)


@interpreted_kernels
def test_a_speculating_worker_samples_every_step_with_the_device_sampler(tiny_model_dir):
    """--sampler kernels (interpreted on the CPU) with speculation: plain steps and steps that verify
    drafts both sample with the device sampler (no torch sampler exists), which counts every emitted
    token, and the drafts before each verified position, for penalties: greedy output with every
    penalty equals the plain torch runner's while the two kinds of step alternate; each row's draw
    counter ends at its output index."""
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    config = worker_config_from_args(parser.parse_args(["--model", "m", "--speculative-method", "ngram",
                                                        "--sampler", "kernels"]))
    assert config.speculative_method == "ngram" and config.sampler == "kernels"
    options = pb.SamplingOptions(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    requests = {1: (repeating(6, 3, 5), options), 2: (prompt(7, 11), options)}
    plain = Loop(make_runner(tiny_model_dir))
    expected = plain.run(requests, 24)
    with gpu_faithful():
        loop, runner, calls = _mixed_steps(tiny_model_dir, requests, plain)
    assert {s: loop.tokens[s][len(p):len(p) + 24] for s, (p, _) in requests.items()} == expected
    assert calls["sample"] > 3 and calls["sample_ahead"] > 3 and loop.num_accepted > 3
    for seq_id, (p, _) in requests.items():
        row = runner.batch.row_of[seq_id]
        assert int(runner.device_sampler.counters[row]) == len(loop.tokens[seq_id]) - len(p)


def _mixed_steps(tiny_model_dir, requests, plain):
    runner = ngram_runner(tiny_model_dir, sampler="kernels")
    assert runner.device_sampler is not None and runner.sampler is None
    calls = {"sample": 0, "sample_ahead": 0}
    for name in calls:
        method = getattr(runner.device_sampler, name)
        setattr(runner.device_sampler, name, lambda *args, name=name, method=method, **kw:
                calls.__setitem__(name, calls[name] + 1) or method(*args, **kw))
    loop = Loop(runner)
    runner.bookkeeping.propose_on_host = oracle(runner, plain.tokens)
    loop.start(requests)
    while min(len(loop.tokens[s]) - len(p) for s, (p, _) in requests.items()) < 24:
        loop.propose = loop.step_id % 4 < 2    # two steps proposing, two not: verifying and plain steps mix
        loop.decode()
    return loop, runner, calls
