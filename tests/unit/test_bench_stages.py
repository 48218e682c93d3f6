"""The benchmark driver (bench/gpu_bench.py) and its decode stage's sizing, without a GPU: stages
are expanded and preceded by what they read, and every decode case reaches steps where its whole
batch decodes, under the real Scheduler."""
from __future__ import annotations

import random

import pytest

from bench.gpu_bench import STAGES, selected_stages, with_requirements
from bench.stages.decode import STEPS_IN_FLIGHT, Case, in_flight_depths
from common.sampling import SamplingParams
from scheduler_svc.engine.block_manager import BlockManager
from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.sequence import Sequence


def test_groups_expand_and_each_stage_is_preceded_by_what_it_reads():
    assert selected_stages("decode,moe,decode")[:3] == ["decode", "bandwidth", "moe_kernel"]
    assert set(selected_stages("all")) == set(STAGES)
    assert with_requirements(["decode"], done=set()) == ["checkpoint", "bandwidth", "decode"]
    assert with_requirements(["decode", "service"], done={"bandwidth"}) == ["checkpoint", "decode", "service"]
    assert with_requirements(["bandwidth", "moe_e2e"], done=set()) == ["bandwidth", "moe_e2e"]


def pure_decode_steps(batch: int, context: int, max_tokens: int, budget: int, block_size: int = 16) -> int:
    """Steps, two in flight as the decode stage sends them, in which every request decodes one token."""
    blocks = batch * -(-(context + max_tokens) // block_size)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget,
                                          max_model_len=context + max_tokens + 16, block_size=block_size),
                          BlockManager(blocks, block_size))
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        scheduler.add(Sequence(i + 1, f"r{i}", [rng.randrange(500) for _ in range(context)], params))
    in_flight, pure = [], 0
    while scheduler.has_unfinished() or in_flight:
        while len(in_flight) < STEPS_IN_FLIGHT and scheduler.has_unfinished():
            output = scheduler.schedule()
            if output.is_empty:
                break
            in_flight.append(output)
        output = in_flight.pop(0)
        pure += not output.new_requests and len(output.seqs) == batch and not output.cached.multi_token_indices
        scheduler.update(output, [1] * len(output.sampling_seqs))
    return pure


def test_a_decode_case_whose_prefill_outlasts_the_timed_steps_still_decodes_its_whole_batch():
    """16 x 1024 at a 1024-token budget prefills for 17 steps: requests limited to the warm-up and
    timed steps finish before the last prompt is in (as 256 x 4096 did at 16384), so no step
    decodes the whole batch; the stage's limit leaves every warm-up and timed step."""
    warmup, measured, budget = 2, 8, 1024
    assert pure_decode_steps(16, 1024, warmup + measured + 2, budget) == 0
    case = Case.parse("16x1024", budget, warmup, measured)
    assert pure_decode_steps(case.batch, case.context, case.max_tokens, budget) >= warmup + measured


def test_the_kernel_stages_run_through_the_driver_with_the_flags_it_parses(monkeypatch, tmp_path):
    """`--stages linear,attention`: both are registered, the driver's parser takes the linear
    stage's own flags beside the shared ones, and each stage's run gets what its module expects
    (the attention module takes the folder and the device, not the parsed flags)."""
    from bench import gpu_bench
    from bench.stages import attention, linear

    assert selected_stages("kernels") == ["linear", "attention"]
    assert with_requirements(["linear", "attention"], done=set()) == ["linear", "attention"]
    args = gpu_bench.parse_args(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--parts", "sweep",
                                 "--rows", "1,4", "--run-stage", "linear"])
    assert (args.parts, args.rows, args.tiny, args.models) == ("sweep", "1,4", True, "8b,0.6b")
    calls = []
    monkeypatch.setattr(linear, "run", lambda a: calls.append(("linear", a.parts)) or {"rows": 2})
    monkeypatch.setattr(attention, "run", lambda out, *, device: calls.append(("attention", out, device)) or {})
    assert STAGES["linear"].run(args) == {"rows": 2}
    assert STAGES["attention"].run(args) == {}
    assert calls == [("linear", "sweep"), ("attention", tmp_path, "cpu")]
    assert gpu_bench.run_stage(args) == 0
    assert '"rows": 2' in (tmp_path / "linear.json").read_text()


def test_the_service_stage_counts_the_kernels_the_worker_compiled_during_its_run(tmp_path):
    from bench.stages.service import late_compiles_in

    log = tmp_path / "worker.log"
    log.write_text("INFO serving\nWARNING kernel _a compiled after start-up in 900 ms (the step waited for it): X=1\n")
    start = log.stat().st_size
    assert late_compiles_in(log) == 1 and late_compiles_in(log, start) == 0
    with log.open("a") as f:
        f.write("WARNING kernel _b compiled after start-up in 3 ms (the step waited for it): Y=2\nINFO done\n")
    assert late_compiles_in(log, start) == 1 and late_compiles_in(tmp_path / "missing.log") == 0


def test_the_decode_stage_keeps_steps_in_flight_as_the_engine_core_does_unless_told():
    """auto: four up to the engine core's fourth-step bound (4 requests), three up to its third-step
    bound (32), two past it; a list measures each case at each depth; depths past what the cases'
    lengths allow are refused."""
    import argparse

    from scheduler_svc.engine.config import FOURTH_STEP_MAX_SEQS, THIRD_STEP_MAX_SEQS, EngineConfig

    assert EngineConfig().third_step_max_seqs == THIRD_STEP_MAX_SEQS == 32
    assert EngineConfig().fourth_step_max_seqs == FOURTH_STEP_MAX_SEQS == 4
    auto = argparse.Namespace(decode_in_flight="auto")
    assert [in_flight_depths(auto, batch) for batch in (1, 4, 5, 32, 33, 256)] == [[4], [4], [3], [3], [2], [2]]
    assert in_flight_depths(argparse.Namespace(decode_in_flight="2,3"), 1) == [2, 3]
    with pytest.raises(ValueError, match="each depth"):
        in_flight_depths(argparse.Namespace(decode_in_flight="5"), 1)


def test_the_service_stage_floors_each_logged_step(tmp_path):
    """The service stage's floor of a logged step: a decode step's is bench/floor.py's; a step with
    prefill chunks takes at least its linear FLOPs at the bf16 rate; without the bandwidth stage's
    rates there is none."""
    import argparse
    import json

    from bench.floor import ModelShape, decode_step_floor_s
    from bench.stages.service import step_floor_ms

    config = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                  intermediate_size=128, vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = argparse.Namespace(model=tmp_path, out=tmp_path)
    rates = dict(copy_bytes_per_s=1e9, bf16_flops_per_s=1e11, fp8_flops_per_s=2e11)
    floor_ms = step_floor_ms(args, {"bandwidth": {"ok": True, "result": rates}})
    shape = ModelShape(config)
    assert floor_ms(4, 4, 4, 400) == decode_step_floor_s(shape, 4, 400, rates) * 1e3
    prefill_ms = floor_ms(2, 1, 4096, 4096)
    assert prefill_ms >= 2 * 4096 * shape.active_linear() / rates["bf16_flops_per_s"] * 1e3
    assert prefill_ms > floor_ms(2, 2, 2, 4096)
    assert step_floor_ms(args, {}) is None


def test_the_profile_charges_overlapping_kernels_only_the_time_they_add_to_the_busy_span():
    """PDL kernels start before the one ahead ends: each is charged only what it adds to the union."""
    from bench.stages.profile import busy_attribution

    busy, added = busy_attribution([(0, 10, "gemv"), (8, 12, "norm"), (9, 11, "attention"), (20, 25, "gemv"),
                                    (21, 23, "norm")])
    assert busy == 10 + 2 + 5
    assert added == {"gemv": 15, "norm": 2}
    assert busy_attribution([]) == (0.0, {})
