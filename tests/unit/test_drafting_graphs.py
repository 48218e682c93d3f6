"""A device proposer's own passes replay CUDA graphs (spec_decode/drafting_graphs.py, the
catch-up over the target's decode graphs' inputs): on the CPU, with graphs whose replay runs what
they captured again and an attention that reads every length from the metadata's device tensors
(so a replay that left a stale one there would show), a speculating runner whose target, catch-up
and drafting passes all replay graphs gives transformers' greedy output token for token, and the
same drafts (so the same acceptance) as the same runner run eagerly. Steps with more requests than
the drafting graphs hold run the passes eagerly."""
from __future__ import annotations

import contextlib

import pytest

from tests.support.graph_stand_ins import cpu_only, speculating_runner
from tests.support.hf_reference import hf_greedy
from tests.support.markers import requires_cuda
from tests.support.runner_driver import GREEDY, make_runner, prompt
from tests.support.speculative_loop import Loop
from tests.support.triton_interpreter import gpu_faithful


def recording(run, drafted: list):
    """The proposer's run, noting each step's drafts (on the CPU they are the graphs' static
    buffer itself, not a copy on its way to the host: noted as lists)."""
    def recorded(*args):
        result = run(*args)
        drafted.append(None if result is None else result[0].tolist())
        return result
    return recorded


def replays(graphs) -> int:
    return sum(graph.replays for graph in graphs.graphs.values())


@cpu_only
@pytest.mark.parametrize("staged", [False, True], ids=["inputs-copied", "inputs-staged"])
@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_the_proposers_graphs_draft_as_its_eager_passes(tiny_model_dir, tiny_self_draft_dir, tiny_eagle3_dir,
                                                        graphs_on_the_cpu, method, staged):
    head = tiny_self_draft_dir if method == "draft" else tiny_eagle3_dir
    # Three requests: drafting graphs of 4 rows, one a padding row; verifying steps of 12 tokens in
    # the target's and the catch-up's graphs of 16.
    requests = {1: (prompt(4, 21), GREEDY), 2: (prompt(5, 6), GREEDY), 3: (prompt(6, 13), GREEDY)}
    loops = {}
    for graphed in (False, True):
        with gpu_faithful() if staged else contextlib.nullcontext():   # the device sampler's kernels, interpreted
            loop = loops[graphed] = Loop(speculating_runner(tiny_model_dir, method, head, graphed, staged=staged))
            loop.runner.drafter.run = recording(loop.runner.drafter.run, drafted := [])
            if graphed:   # staged steps replay without copying their inputs in
                graphs, copied = loop.runner.decode_graphs, []
                graphs.run = lambda *args, run=graphs.run, copied=copied: copied.append(args) or run(*args)
            outputs = loop.run(requests, 8)
        for seq_id, (p, _) in requests.items():
            assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 8), f"{method}, graphs {graphed}, sequence {seq_id}"
        loop.drafts = [d for d in drafted if d is not None]
    eager, graphed = loops[False], loops[True]
    assert graphed.drafts == eager.drafts and graphed.num_accepted == eager.num_accepted
    drafter = graphed.runner.drafter
    assert graphed.runner.decode_graphs.staged == staged and (copied == []) == staged
    assert replays(graphed.runner.decode_graphs) >= len(graphed.drafts) - 1   # every decode step's forward
    assert replays(drafter.drafting_graphs) == len(graphed.drafts) > 2
    assert replays(drafter.catch_up_graphs) >= len(graphed.drafts) - 1   # every decode step's catch-up
    if method == "draft":   # the target's own drafts
        assert graphed.num_accepted >= 0.9 * 3 * graphed.num_verified > 0


@cpu_only
def test_steps_with_more_requests_than_the_graphs_hold_draft_eagerly(tiny_model_dir, tiny_self_draft_dir,
                                                                      graphs_on_the_cpu):
    runner = speculating_runner(tiny_model_dir, "draft", tiny_self_draft_dir, True, graph_requests=1)
    loop = Loop(runner)
    requests = {1: (prompt(6, 9), GREEDY), 2: (prompt(7, 12), GREEDY)}
    outputs = loop.run(requests, 8)
    for seq_id, (p, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 8), f"sequence {seq_id}"
    assert replays(runner.drafter.drafting_graphs) == 0 and loop.num_accepted > 0


@requires_cuda
@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_on_a_gpu_the_proposers_graphs_give_the_targets_greedy_output(tiny_model_dir, tiny_self_draft_dir,
                                                                      tiny_eagle3_dir, method):
    """Real graphs (float32, the tiny model): the target, the catch-up and the drafting passes all
    replay, greedy output equals transformers', and the self-draft's drafts are accepted."""
    head = tiny_self_draft_dir if method == "draft" else tiny_eagle3_dir
    runner = make_runner(tiny_model_dir, device="cuda", dtype="float32", speculative_method=method,
                         speculative_model=str(head), num_speculative_tokens=3, max_num_seqs=16)
    drafter = runner.drafter
    assert runner.decode_graphs is not None and drafter.drafting_graphs is not None
    calls = {"drafting": 0, "catch_up": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    drafter.drafting_graphs.run = counted("drafting", drafter.drafting_graphs.run)
    drafter.catch_up_graphs.replay = counted("catch_up", drafter.catch_up_graphs.replay)
    requests = {1: (prompt(4, 21), GREEDY), 2: (prompt(5, 6), GREEDY), 3: (prompt(6, 13), GREEDY)}
    loop = Loop(runner)
    outputs = loop.run(requests, 16)
    for seq_id, (p, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 16), f"{method}, sequence {seq_id}"
    assert calls["drafting"] > 3 and calls["catch_up"] >= calls["drafting"] - 1
    if method == "draft":
        assert loop.num_accepted >= 0.9 * 3 * loop.num_verified > 0
