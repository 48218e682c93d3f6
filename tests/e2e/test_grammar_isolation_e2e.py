"""No grammar can slow or break anyone else's request (real processes): a grammar that takes longer
than the worker's budget to compile is refused with INVALID_ARGUMENT naming it (and the next one
compiles); a request whose masks cost more than the budget per step is ended alone, while free
requests beside it get exactly the tokens they get alone; a worker without xgrammar (or without
pydantic, which xgrammar needs) says so in GetModelInfo, refuses structured output with
UNIMPLEMENTED naming the package, and is never reset for it."""
from __future__ import annotations

import json
import threading

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1 import generation_pb2_grpc
from tests.support.client import generate, generate_many, model_info
from worker_svc.grammar_pool import STARTUP_TIMEOUT_S

# A grammar's compiling child runs niced: on a busy machine it takes minutes to start (the pool
# allows STARTUP_TIMEOUT_S; more than the client's default 240 s deadline with six busy loops on two
# cores), and one test here waits for two (the first, and the one replacing the child killed).
pytestmark = pytest.mark.timeout(1800)

EOS_IDS = (0, 2)          # the tiny checkpoint's
GRAMMAR_DEADLINE_S = STARTUP_TIMEOUT_S + 120    # a request whose grammar may wait for a child to start
# The worker's compile budget, and a schema far beyond it: the one test-side wait it costs is the
# budget itself (the compilation is killed then). A small schema compiles in ~3 ms idle and ~0.06-0.13 s
# with six busy loops (its child niced); arrays nested 800 deep take ~30 s idle (600: 14 s, 300: 1.9 s).
BUDGET_S = 3
OVER_BUDGET_DEPTH = 800
FREE = [dict(token_ids=[10 + i, 20, 30], temperature=0.0, ignore_eos=True, max_tokens=60) for i in range(3)]


def _nested_arrays(depth: int) -> str:
    schema = '{"type": "string"}'
    for _ in range(depth):
        schema = '{"type": "array", "items": ' + schema + "}"
    return schema


@pytest.fixture(scope="module")
def budgeted(tiny_model_dir, tmp_path_factory):
    from tests.support.procs import running_services

    with running_services(tiny_model_dir, tmp_path_factory.mktemp("budget-logs"),
                          worker_args=("--grammar-compile-timeout", str(BUDGET_S), "--max-mask-ms", "5"),
                          # a first grammar's wait for its child is no hung step
                          scheduler_args=("--max-json-depth", str(OVER_BUDGET_DEPTH + 100),
                                          "--step-timeout", str(GRAMMAR_DEADLINE_S))) as svc:
        yield svc


def test_a_grammar_over_its_compile_budget_is_refused_naming_it_and_the_next_compiles(budgeted):
    with budgeted.channel() as ch:
        for _ in range(2):       # the second time from the worker's memory of the refusal
            with pytest.raises(grpc.RpcError) as refused:
                generate(ch, text="Hi", max_tokens=4, json_schema=_nested_arrays(OVER_BUDGET_DEPTH),
                         timeout=GRAMMAR_DEADLINE_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(
                f"sampling.json_schema is invalid: it takes over {BUDGET_S} s to compile")
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        # compiled by the child started in place of the one killed
        out = generate(ch, text="Hi", max_tokens=40, temperature=0.0, json_schema=json.dumps(schema),
                       skip_special_tokens=True, timeout=GRAMMAR_DEADLINE_S)
        if out.finish_reason == pb.FINISH_REASON_STOP:
            assert isinstance(json.loads(out.text)["n"], int)


def test_masks_costlier_than_the_budget_end_their_request_alone(budgeted):
    """An ambiguous regex (nested stars): each token makes its mask costlier, until it passes the
    budget; the free requests beside it are untouched."""
    ambiguous = dict(text="a", regex="(a*a*a*a*a*a*)*", ignore_eos=True, max_tokens=400, temperature=0.0,
                     logit_bias={eos: -100.0 for eos in EOS_IDS})
    with budgeted.channel() as ch:
        alone = [out.token_ids for out in generate_many(ch, FREE)]
        failure: list[grpc.RpcError] = []

        def run_ambiguous() -> None:
            try:
                generate(ch, **ambiguous, timeout=GRAMMAR_DEADLINE_S)
            except grpc.RpcError as e:
                failure.append(e)

        thread = threading.Thread(target=run_ambiguous)
        thread.start()
        beside = [out.token_ids for out in generate_many(ch, FREE)]
        thread.join(GRAMMAR_DEADLINE_S + 60)
        assert beside == alone
        assert failure, "the ambiguous regex ran to its end within the budget"
        assert failure[0].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert failure[0].details().startswith("sampling.regex is too costly to follow: its token mask took")
        assert "--max-mask-ms" in failure[0].details()
        group = model_info(ch).worker_groups[0]
        assert group.healthy and group.num_free_kv_blocks == group.num_kv_blocks
    assert "marking it down" not in budgeted.scheduler.log.read_text()


@pytest.mark.parametrize("package", ["xgrammar", "pydantic"])
def test_without_a_package_structured_output_is_refused_and_the_worker_is_never_reset(
        launch_services, tmp_path, package):
    fake = tmp_path / "missing" / package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{package}'\", name={package!r})\n")
    with launch_services(worker_env={"PYTHONPATH": str(fake.parent)}) as svc, svc.channel() as ch:
        [feature] = [f for f in model_info(ch).features if f.name == "structured_output"]
        assert not feature.available and repr(package) in feature.detail
        stub = generation_pb2_grpc.GenerationStub(ch)
        tool = pb.Tool(name="f", parameters_json='{"type": "object"}')
        for refused_call in (
                lambda: generate(ch, text="Hi", max_tokens=4, json_schema='{"type": "object"}'),
                lambda: generate(ch, text="Hi", max_tokens=4, regex="a+"),
                lambda: list(stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")],
                                                      tools=[tool], tool_choice="required"), timeout=60))):
            with pytest.raises(grpc.RpcError) as refused:
                refused_call()
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert repr(package) in refused.value.details()
        assert [out.token_ids for out in generate_many(ch, FREE)] == [out.token_ids for out in generate_many(ch, FREE)]
        assert model_info(ch).worker_groups[0].healthy
    worker_log = svc.workers[0].log.read_text()
    assert "Traceback" not in worker_log and "reset: every request mirror dropped" in worker_log
    assert worker_log.count("reset: every request mirror dropped") == 1     # the connect's, and no other
    assert "marking it down" not in svc.scheduler.log.read_text()
