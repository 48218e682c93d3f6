"""A verifying step launched before the step in flight is settled (worker_svc/spec_decode/ahead.py):
its inputs derived on the device (positions, slots, input ids, lengths, the drafts it verifies, the
drafting plan's start) equal those the host builds after the settle, for every acceptance (all
drafts rejected, all accepted, some; a row verifying none), eagerly and staged for the graphs, and
the batch ends in the same state; a scheduler that schedules ahead gets every verifying step after
the first launched so, with greedy output equal to transformers' and to a runner without
speculation; steps it cannot derive (two in flight) settle first and stay exact."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from common.pb.llm.worker.v1 import worker_pb2 as pb
from tests.support.graph_stand_ins import cpu_only, speculating_runner
from tests.support.hf_reference import hf_greedy
from tests.support.markers import requires_cuda
from tests.support.runner_driver import GREEDY, make_runner, prompt
from tests.support.speculative_loop import AheadLoop, Loop
from tests.support.triton_interpreter import INTERPRETED, gpu_faithful
from worker_svc import model_runner
from worker_svc.runner_io import InvalidStepError

# On the CPU: graph stand-ins, and the derivation's kernel interpreted (a GPU runs the last test).
interpreted = pytest.mark.skipif(not INTERPRETED, reason="the derivation's kernel, interpreted")

K = 3
# Prompts ending on both sides of a block boundary (16); request 4 never speculates (verifies none).
REQUESTS = {1: (prompt(11, 14), GREEDY), 2: (prompt(12, 15), GREEDY), 3: (prompt(13, 30), GREEDY),
            4: (prompt(14, 9), pb.SamplingOptions(temperature=0.0, speculative=False))}
# Drafts each request accepts, step after step: none, all, some.
ACCEPTANCES = [[0, 3, 1, 0], [3, 3, 3, 0], [2, 0, 3, 0], [0, 0, 0, 0], [1, 2, 0, 0], [3, 1, 2, 0]]


def forced_acceptance(monkeypatch, acceptances) -> None:
    """Each verification accepts the given counts (within the drafts verified), whatever was sampled."""
    counts = itertools.cycle(acceptances)

    def accept(tokens, layout):
        accepted = torch.minimum(torch.tensor(next(counts))[:len(layout.first)], layout.num_drafts)
        return accepted, layout.offset <= accepted[layout.owner], layout.first + accepted
    monkeypatch.setattr(model_runner, "accept", accept)


def recording_inputs(runner) -> list[dict]:
    """Each step's forward inputs (after a staged step's unpacking), the drafts it verifies and the
    drafting plan's starts, as lists."""
    seen = []
    execute = runner._execute

    def recorded(step_id, batch, *args):
        entry = {"ahead": batch.ahead}
        if batch.verify is not None:
            entry["next_drafts"] = batch.verify.next_drafts.tolist()
        if batch.draft_plan is not None:
            entry["base"] = batch.draft_plan.base_positions.tolist()
        if not batch.graph:
            entry |= {"ids": batch.input_ids.tolist(), "positions": batch.positions.tolist(),
                      "slots": batch.meta.slot_mapping.tolist(), "seq_lens": batch.meta.seq_lens.tolist()}
        seen.append(entry)
        return execute(step_id, batch, *args)
    runner._execute = recorded
    graphs = runner.decode_graphs
    if graphs is not None:
        def replayed(n, replay=graphs.replay):
            hidden = replay(n)
            seen[-1] |= {"ids": graphs.input_ids[:n].tolist(), "positions": graphs.positions[:n].tolist(),
                         "slots": graphs.slot_mapping[:n].tolist(), "seq_lens": graphs.seq_lens[:n].tolist()}
            return hidden
        graphs.replay = replayed
    return seen


def batch_state(runner) -> dict:
    b = runner.batch
    rows = b.rows_of(list(REQUESTS))
    held = b.num_drafts[rows]
    return {"computed": b.num_computed[rows].tolist(), "tokens": b.num_tokens[rows].tolist(),
            "host": b.num_host_tokens[rows].tolist(), "held": held.tolist(),
            "ids": [b.token_ids[r, :b.num_tokens[r]].tolist() for r in rows],
            "drafts": [b.draft_tokens[r, :h].tolist() for r, h in zip(rows, held)]}


def settled_and_ahead(tiny_model_dir, tiny_eagle3_dir, monkeypatch, acceptances, requests, staged=False,
                      state=batch_state, **loop) -> tuple[list[bool], tuple]:
    """The same steps run with each launched once the one before is settled (depth 1) and ahead of
    it (depth 2), every verification accepting `acceptances`; asserts that both runs gave every step
    the same inputs and ended with the same outputs and batch state. Returns whether each step of the
    second run went ahead, and that end (outputs, state)."""
    runs = {}
    for depth in (1, 2):
        forced_acceptance(monkeypatch, acceptances)
        runner = speculating_runner(tiny_model_dir, "eagle3", tiny_eagle3_dir, graphed=staged, staged=staged)
        seen = recording_inputs(runner)
        with gpu_faithful() if staged else contextlib.nullcontext():
            outputs = AheadLoop(runner, K, depth, **loop).run(requests, 24, steps=len(acceptances) + 1)
        runs[depth] = (seen, outputs, state(runner))
    (settled, *settled_end), (ahead, *ahead_end) = runs[1], runs[2]
    assert [entry.pop("ahead") for entry in settled] == [False] * len(settled)
    flags = [entry.pop("ahead") for entry in ahead]
    assert len(ahead) == len(settled)
    for step, (built, derived) in enumerate(zip(settled, ahead), start=1):
        assert derived == built, f"step {step}"
    assert ahead_end == settled_end
    return flags, tuple(settled_end)


@cpu_only
@interpreted
@pytest.mark.parametrize("staged", [False, True], ids=["eager", "staged"])
def test_inputs_derived_on_the_device_equal_those_built_on_the_host_after_the_settle(
        tiny_model_dir, tiny_eagle3_dir, graphs_on_the_cpu, monkeypatch, staged):
    flags, end = settled_and_ahead(tiny_model_dir, tiny_eagle3_dir, monkeypatch, ACCEPTANCES, REQUESTS, staged)
    assert flags == [False] + [True] * len(ACCEPTANCES)
    held = end[1]["held"]
    assert any(n == 0 for n in held) and max(held) == K


# Steps that decode the requests in other orders and subsets of them: a row's place in the step
# before is looked up (a step with a row the one before did not decode settles first).
ORDERS = [[1, 2, 3, 4], [4, 3, 2, 1], [2, 4, 1, 3], [1, 3], [3, 1, 4, 2], [2, 1, 4, 3], [4, 2]]


@cpu_only
@interpreted
@pytest.mark.parametrize("staged", [False, True], ids=["eager", "staged"])
@pytest.mark.parametrize("on_demand", [False, True], ids=["all-blocks", "blocks-on-demand"])
def test_rows_in_other_orders_and_blocks_that_arrive_with_the_step_derive_the_same_inputs(
        tiny_model_dir, tiny_eagle3_dir, graphs_on_the_cpu, monkeypatch, staged, on_demand):
    """Blocks on demand: each step brings the blocks its largest acceptance may need, so rows cross
    block boundaries in the steps launched ahead."""
    flags, _ = settled_and_ahead(
        tiny_model_dir, tiny_eagle3_dir, monkeypatch, ACCEPTANCES, REQUESTS, staged, orders=ORDERS,
        on_demand=on_demand)
    assert sum(flags) >= 3 and not all(flags[1:])   # [1, 3] then [3, 1, 4, 2]: that one settles


@cpu_only
@interpreted
def test_a_step_that_asks_for_no_drafts_and_the_steps_after_it_derive_the_same_inputs(
        tiny_model_dir, tiny_eagle3_dir, graphs_on_the_cpu, monkeypatch):
    flags, _ = settled_and_ahead(
        tiny_model_dir, tiny_eagle3_dir, monkeypatch, ACCEPTANCES, REQUESTS, on_demand=True,
        proposes=[True, False, True, True])
    assert any(flags)


@cpu_only
@interpreted
@pytest.mark.parametrize("steps", [3, 4])
def test_rows_reaching_max_model_len_derive_the_same_inputs(tiny_model_dir, tiny_eagle3_dir, graphs_on_the_cpu,
                                                             monkeypatch, steps):
    """Prompts of 50 and 47 tokens under max_model_len 64: a row whose drafts could run past it
    settles first; the rest go ahead."""
    requests = {1: (prompt(11, 50), GREEDY), 2: (prompt(12, 47), GREEDY)}

    def state(runner):
        b = runner.batch
        rows = b.rows_of(list(requests))
        return b.num_computed[rows].tolist(), b.num_tokens[rows].tolist(), b.num_drafts[rows].tolist()

    acceptances = [[3, 3], [3, 3], [1, 2], [3, 3]][:steps - 1]
    settled_and_ahead(tiny_model_dir, tiny_eagle3_dir, monkeypatch, acceptances, requests, state=state)


@cpu_only
@interpreted
def test_a_step_without_the_blocks_its_acceptance_needs_is_refused_as_when_settled_first(
        tiny_model_dir, tiny_eagle3_dir, graphs_on_the_cpu, monkeypatch):
    """A step goes ahead only when its blocks hold the largest acceptance; this one's do not (every
    draft accepted, no new blocks sent), so it settles first and the step checks refuse it."""
    requests = {1: (prompt(21, 14), GREEDY), 2: (prompt(22, 30), GREEDY)}
    refused = {}
    for depth in (1, 2):
        forced_acceptance(monkeypatch, [[K, K]])
        runner = speculating_runner(tiny_model_dir, "eagle3", tiny_eagle3_dir, graphed=False)
        loop = AheadLoop(runner, K, depth)
        with pytest.raises(InvalidStepError) as caught:
            loop.run(requests, 1, steps=8)
        refused[depth] = (loop.step_id, str(caught.value))
    assert refused[2] == refused[1] and "block" in refused[1][1]


@cpu_only
@interpreted
@pytest.mark.parametrize("staged", [False, True], ids=["eager", "staged"])
@pytest.mark.parametrize("method", ["eagle3", "draft"])
def test_a_scheduler_ahead_gets_its_verifying_steps_launched_before_the_settle(
        tiny_model_dir, tiny_eagle3_dir, tiny_self_draft_dir, graphs_on_the_cpu, method, staged):
    """eagle3's random head has every draft rejected, the self-draft every draft accepted."""
    head = tiny_eagle3_dir if method == "eagle3" else tiny_self_draft_dir
    requests = {1: (prompt(1, 20), GREEDY), 2: (prompt(2, 9), GREEDY), 3: (prompt(3, 13), GREEDY)}
    plain = Loop(make_runner(tiny_model_dir)).run(requests, 10)
    runner = speculating_runner(tiny_model_dir, method, head, graphed=staged, staged=staged)
    seen = recording_inputs(runner)
    with gpu_faithful() if staged else contextlib.nullcontext():
        loop = AheadLoop(runner, K)
        outputs = loop.run(requests, 10)
    assert outputs == plain
    for seq_id, (p, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 10), f"sequence {seq_id}"
    assert [entry["ahead"] for entry in seen] == [False] + [True] * (len(seen) - 1)
    assert (loop.num_accepted > 0) == (method == "draft")


@cpu_only
@interpreted
def test_with_two_steps_in_flight_a_step_settles_first_and_stays_exact(tiny_model_dir, tiny_self_draft_dir,
                                                                       graphs_on_the_cpu):
    requests = {1: (prompt(5, 17), GREEDY), 2: (prompt(6, 8), GREEDY)}
    runner = speculating_runner(tiny_model_dir, "draft", tiny_self_draft_dir, graphed=False)
    seen = recording_inputs(runner)
    loop = AheadLoop(runner, K, depth=3)
    outputs = loop.run(requests, 12)
    for seq_id, (p, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 12), f"sequence {seq_id}"
    flags = [entry["ahead"] for entry in seen]
    assert flags[:3] == [False, True, False] and False in flags[3:] and loop.num_accepted > 0


@cpu_only
@interpreted
def test_a_step_admitting_a_request_settles_first(tiny_model_dir, tiny_eagle3_dir, graphs_on_the_cpu):
    runner = speculating_runner(tiny_model_dir, "eagle3", tiny_eagle3_dir, graphed=False)
    seen = recording_inputs(runner)
    loop = AheadLoop(runner, K)
    first, second = prompt(7, 12), prompt(8, 5)
    loop.tokens = {1: list(first)}
    decode = pb.CachedRequests(seq_ids=[1], draft_indices=[0], draft_counts=[K])
    loop._launch(pb.StepRequest(new_requests=[pb.NewRequest(seq_id=1, token_ids=first, num_prompt_tokens=12,
                                                            num_scheduled_tokens=12, block_ids=[0, 1],
                                                            sampling=GREEDY)], propose_drafts=True), [1])
    loop._launch(pb.StepRequest(cached=decode, propose_drafts=True), [1])   # ahead; the prefill's reply read
    new = pb.NewRequest(seq_id=9, token_ids=second, num_prompt_tokens=5, num_scheduled_tokens=5, block_ids=[2],
                        sampling=GREEDY)
    loop._launch(pb.StepRequest(cached=decode, new_requests=[new], propose_drafts=True), [1, 9])
    assert [entry["ahead"] for entry in seen] == [False, True, False]
    last = loop.in_flight.pop(0)[0].result()
    assert last.token_ids[-1] == hf_greedy(tiny_model_dir, second, 1)[0]
    produced = loop.tokens[1][12:] + last.token_ids[:-1]
    assert produced == hf_greedy(tiny_model_dir, first, len(produced))


@requires_cuda
@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_on_a_gpu_verifying_steps_go_ahead_with_the_targets_greedy_output(tiny_model_dir, tiny_self_draft_dir,
                                                                          tiny_eagle3_dir, method):
    """Real graphs and the device sampler (float32, the tiny model): every verifying step after the
    first is launched ahead, greedy output equals transformers', the self-draft's drafts are accepted."""
    head = tiny_self_draft_dir if method == "draft" else tiny_eagle3_dir
    runner = make_runner(tiny_model_dir, device="cuda", dtype="float32", speculative_method=method,
                         speculative_model=str(head), num_speculative_tokens=K, max_num_seqs=16)
    assert runner.decode_graphs is not None and runner.decode_graphs.staged
    flags = []
    execute = runner._execute
    runner._execute = lambda step_id, batch, *args: flags.append(batch.ahead) or execute(step_id, batch, *args)
    requests = {1: (prompt(1, 40), GREEDY), 2: (prompt(2, 9), GREEDY), 3: (prompt(3, 17), GREEDY)}
    loop = AheadLoop(runner, K)
    outputs = loop.run(requests, 16)
    for seq_id, (p, _) in requests.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 16), f"sequence {seq_id}"
    assert flags == [False] + [True] * (len(flags) - 1)
    assert (loop.num_accepted > 0) == (method == "draft")


@cpu_only
@interpreted
def test_start_up_compiles_the_derivation_where_steps_can_go_ahead(tiny_model_dir, tiny_eagle3_dir,
                                                                   graphs_on_the_cpu, monkeypatch):
    """Its first use would otherwise compile it mid-serving: warm_up_derive runs it, with and
    without a drafting plan, over dummy inputs of the step's dtypes; a worker without a proposer on
    the device runs nothing."""
    from worker_svc.spec_decode import ahead

    calls = []
    real = ahead.derive
    monkeypatch.setattr(ahead, "derive", lambda *args: calls.append(args[-1] is not None) or real(*args))
    ahead.warm_up_derive(speculating_runner(tiny_model_dir, "eagle3", tiny_eagle3_dir, graphed=True, staged=True))
    assert calls == [False, True]
    calls.clear()
    ahead.warm_up_derive(make_runner(tiny_model_dir))
    assert calls == []
