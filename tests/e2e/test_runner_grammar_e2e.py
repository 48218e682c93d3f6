"""ModelRunner with grammars, driven step by step as the scheduler would: constrained rows follow
their grammar beside free neighbours they leave untouched, a re-sent request continues its grammar,
a bad or too costly grammar fails its request alone, and a grammar holds over accepted speculative
runs. End-to-end because each runner starts its grammar-compiling process (worker_svc/grammar_pool.py)."""
from __future__ import annotations

import json
import re

import pytest

from common.pb.llm.worker.v1 import worker_pb2 as pb
from scheduler_svc.frontend.tokenizer import load_tokenizer
from tests.support.runner_driver import GREEDY, SAMPLERS, Driver, make_runner, prompt, skip_long_interpreted
from tests.support.speculative_loop import Loop, ngram_runner, repeating
from tests.support.triton_interpreter import gpu_faithful


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_constrained_rows_follow_their_grammar_and_leave_free_neighbours_untouched(tiny_model_dir, sampler):
    skip_long_interpreted(sampler)
    free = pb.SamplingOptions(temperature=1.0, seed=5)
    constrained = pb.Constraint(kind="regex", text=r"(ab|[0-9]{2,4}-)+x")
    alone, mixed = Driver(make_runner(tiny_model_dir, sampler=sampler)), Driver(make_runner(tiny_model_dir, sampler=sampler))
    alone.step(new=[alone.new(1, prompt(12, 9), 9, free)])
    mixed.step(new=[mixed.new(1, prompt(12, 9), 9, free),
                    mixed.new(2, prompt(13, 7), 7, pb.SamplingOptions(temperature=1.0, seed=6), constraint=constrained),
                    mixed.new(3, prompt(14, 7), 7, GREEDY, constraint=constrained)])
    for _ in range(24):
        alone.step(cached=[alone.cached(1)])
        mixed.step(cached=[mixed.cached(s) for s in (1, 2, 3)])
    assert mixed.tokens[1] == alone.tokens[1]
    tokenizer = load_tokenizer(tiny_model_dir)
    for seq_id, length in ((2, 7), (3, 7)):
        output = mixed.tokens[seq_id][length:]
        stop = [i for i, t in enumerate(output) if t in (0, 2)]   # the checkpoint's EOS ids
        text = tokenizer.decode(output[:stop[0]] if stop else output)
        assert re.fullmatch(r"(ab|[0-9]{2,4}-)+x", text) if stop else re.fullmatch(r"(ab|[0-9]{2,4}-)*[0-9a-x-]*", text)
    assert mixed.runner.structured.num_refused == 0


def test_a_re_sent_constrained_request_continues_its_grammar(tiny_model_dir):
    runner = make_runner(tiny_model_dir)
    d = Driver(runner)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}
    constraint = pb.Constraint(kind="json_schema", text=json.dumps(schema))
    options = pb.SamplingOptions(temperature=1.0, seed=9)
    p = prompt(15, 6)
    d.step(new=[d.new(1, p, 6, options, constraint=constraint)])
    for _ in range(3):
        d.step(cached=[d.cached(1)])
    so_far = list(d.tokens[1])                # the scheduler's truth: prompt and 4 outputs
    d.forget(1)
    d.step(new=[d.new(1, so_far, len(so_far), options, num_prompt=6, constraint=constraint)], finished=[1])
    for _ in range(30):
        if d.tokens[1][-1] in (0, 2):
            break
        d.step(cached=[d.cached(1)])
    assert d.tokens[1][-1] in (0, 2), "the grammar ends after 99 at most: EOS is all it allows then"
    text = load_tokenizer(tiny_model_dir).decode(d.tokens[1][6:-1])
    assert d.tokens[1][:len(so_far)] == so_far and 0 <= json.loads(text)["n"] <= 99


def test_a_bad_constraint_fails_its_request_alone_and_the_batch_goes_on(tiny_model_dir):
    free = pb.SamplingOptions(temperature=1.0, seed=5)
    alone, mixed = Driver(make_runner(tiny_model_dir)), Driver(make_runner(tiny_model_dir))
    bad = pb.Constraint(kind="json_schema", text='{"type": "object", "properties": 3}')
    alone.step(new=[alone.new(1, prompt(16, 4), 4, free)])
    mixed.step(new=[mixed.new(1, prompt(16, 4), 4, free), mixed.new(2, prompt(17, 4), 4, constraint=bad)])
    [failure] = mixed.outputs[0].failed
    assert (failure.seq_id, failure.code, failure.about_constraint) == (2, "INVALID_ARGUMENT", True)
    assert failure.message.startswith("is invalid: ")
    for _ in range(3):
        alone.step(cached=[alone.cached(1)])
        mixed.step(cached=[mixed.cached(1)], finished=[2] if 2 in mixed.tokens else [])
        mixed.tokens.pop(2, None)
    assert mixed.tokens[1] == alone.tokens[1] and len(mixed.runner.batch) == 1


def test_a_grammar_whose_masks_cost_more_than_the_budget_fails_its_request_alone(tiny_model_dir):
    free = pb.SamplingOptions(temperature=1.0, seed=5)
    costly = pb.Constraint(kind="regex", text="(a*a*a*a*)*b")
    alone = Driver(make_runner(tiny_model_dir))
    mixed = Driver(make_runner(tiny_model_dir, max_mask_ms=1e-6))    # every mask costs more than that
    alone.step(new=[alone.new(1, prompt(18, 4), 4, free)])
    mixed.step(new=[mixed.new(1, prompt(18, 4), 4, free), mixed.new(2, prompt(19, 4), 4, GREEDY, constraint=costly)])
    [failure] = mixed.outputs[0].failed
    assert (failure.seq_id, failure.code, failure.about_constraint) == (2, "INVALID_ARGUMENT", True)
    assert "too costly" in failure.message and "--max-mask-ms" in failure.message
    # Until the scheduler drops it, the request stays in the batch, allowed only its stop tokens.
    sampled = mixed.step(cached=[mixed.cached(1), mixed.cached(2)])
    assert sampled[2] in (0, 2) and not mixed.outputs[-1].failed
    mixed.step(cached=[mixed.cached(1)], finished=[2])
    alone.step(cached=[alone.cached(1)])
    alone.step(cached=[alone.cached(1)])
    assert mixed.tokens[1] == alone.tokens[1] and mixed.runner.structured.num_over_budget == 1


def test_a_grammar_that_dead_ends_fails_its_request_alone_rather_than_sample_freely(tiny_model_dir):
    """After "a" this grammar allows no token, not even a stop: the request fails naming it (its
    compile-time check sees only a grammar that allows nothing at all), and its neighbour goes on."""
    free = pb.SamplingOptions(temperature=1.0, seed=5)
    dead_end = pb.Constraint(kind="grammar", text='root ::= "a" b\nb ::= b "c"')
    alone, mixed = Driver(make_runner(tiny_model_dir)), Driver(make_runner(tiny_model_dir))
    alone.step(new=[alone.new(1, prompt(20, 4), 4, free)])
    mixed.step(new=[mixed.new(1, prompt(20, 4), 4, free), mixed.new(2, prompt(21, 4), 4, GREEDY, constraint=dead_end)])
    assert not mixed.outputs[0].failed
    a = mixed.tokens[2][-1]
    assert load_tokenizer(tiny_model_dir).decode([a]) == "a"
    mixed.step(cached=[mixed.cached(1), mixed.cached(2)])
    [failure] = mixed.outputs[-1].failed
    assert (failure.seq_id, failure.code, failure.about_constraint) == (2, "INVALID_ARGUMENT", True)
    assert failure.message.startswith("allows no token after the output so far")
    mixed.step(cached=[mixed.cached(1)], finished=[2])
    for _ in range(2):
        alone.step(cached=[alone.cached(1)])
    assert mixed.tokens[1] == alone.tokens[1]
    assert mixed.runner.structured.num_dead_ends == 1 and mixed.runner.structured.num_refused == 0


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_grammar_holds_over_accepted_runs(tiny_model_dir, sampler):
    """With either sampler (the device sampler draws the verified positions from the masked logits,
    each position's mask the grammar's after the drafts before it), the output equals the plain
    runner's token for token."""
    pattern = r"(ab|[0-9]{2,4}-)+x"
    constraint = pb.Constraint(kind="regex", text=pattern)
    options = pb.SamplingOptions(temperature=0.0, constraint=constraint)
    seeded = pb.SamplingOptions(temperature=1.0, seed=3, constraint=constraint)
    requests = {1: (repeating(6, 4, 4), options), 2: (repeating(7, 3, 4), seeded)}
    with gpu_faithful():
        speculative = Loop(ngram_runner(tiny_model_dir, sampler=sampler))
        outputs = speculative.run(requests, 20)
        assert outputs == Loop(make_runner(tiny_model_dir, sampler=sampler)).run(requests, 20)
    assert (speculative.runner.sampler is None) == (sampler == "kernels")
    assert speculative.num_verified > 0 and speculative.runner.structured.num_refused == 0
    tokenizer = load_tokenizer(tiny_model_dir)
    for output in outputs.values():
        stop = [i for i, t in enumerate(output) if t in (0, 2)]
        if stop:
            assert re.fullmatch(pattern, tokenizer.decode(output[:stop[0]]))
