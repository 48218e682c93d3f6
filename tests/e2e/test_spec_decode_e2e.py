"""Speculative decoding through the real processes (a worker proposing ngram drafts): greedy
output equals transformers' token for token, sampled output equals the same request's without
speculation, stop strings inside accepted runs, preemption, aborts and a worker restart lose or
repeat no token, and the metrics count what the clients saw."""
from __future__ import annotations

import random
import time

import pytest

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tools.loadtest.metrics import scrape_metrics
from tests.support.client import generate_many, model_info
from tests.support.hf_reference import hf_greedy
from tests.support.procs import free_port, running_services, scheduler_proc, worker_proc
from tests.support.worker_restart import stream_across_a_worker_restart

pytestmark = pytest.mark.timeout(300)

NGRAM = ("--speculative-method", "ngram", "--num-speculative-tokens", "4")


def _repeating(rng: random.Random, period: int, repeats: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(period)] * repeats


def _requests(rng_seed: int, n: int, max_tokens: int, **sampling) -> list[dict]:
    rng = random.Random(rng_seed)
    return [dict(token_ids=_repeating(rng, rng.randint(2, 8), rng.randint(3, 6)), ignore_eos=True,
                 max_tokens=max_tokens, **({"temperature": 0.0} | sampling)) for _ in range(n)]


def _spec_counters(port: int) -> tuple[float, float, float, float]:
    m = scrape_metrics(port)
    return (m["llm_spec_decode_verifications_total"], m["llm_spec_decode_draft_tokens_total"],
            m["llm_spec_decode_accepted_tokens_total"], m["llm_sampled_tokens_total"])


@pytest.fixture(scope="module")
def ngram_services(tiny_model_dir, tmp_path_factory):
    port = free_port()
    with running_services(tiny_model_dir, tmp_path_factory.mktemp("spec-logs"), worker_args=NGRAM,
                          scheduler_args=("--metrics-port", str(port))) as svc, svc.channel() as ch:
        yield svc, ch, port


def test_greedy_with_ngram_drafts_equals_transformers_and_drafts_are_accepted(tiny_model_dir, ngram_services):
    _, ch, port = ngram_services
    info = model_info(ch)
    assert (info.speculative_method, info.num_speculative_tokens) == ("ngram", 4)
    requests = _requests(1, 8, 40)
    before = _spec_counters(port)
    completions = generate_many(ch, requests)
    verifications, drafts, accepted, sampled = (b - a for a, b in zip(before, _spec_counters(port)))
    for i, (req, got) in enumerate(zip(requests, completions)):
        assert got.token_ids == hf_greedy(tiny_model_dir, req["token_ids"], 40), f"request {i}"
    # The metrics count what the clients saw: every token is a verification's own, an accepted
    # draft or a plain sample.
    assert sampled == sum(len(c.token_ids) for c in completions) == 8 * 40
    assert 0 < accepted <= drafts and 0 < verifications + accepted <= sampled


def test_sampled_output_is_the_same_with_and_without_speculation(ngram_services):
    _, ch, port = ngram_services
    sampling = dict(temperature=0.8, top_p=0.95, top_k=50, presence_penalty=0.2, repetition_penalty=1.1,
                    logprobs=True, top_logprobs=2, seed=17, logit_bias={7: 1.5})
    requests = _requests(2, 6, 30, **sampling)
    speculative = generate_many(ch, requests)
    plain = generate_many(ch, [r | {"speculative": False} for r in requests])
    for s, p in zip(speculative, plain):
        assert s.token_ids == p.token_ids and s.finish_reason == p.finish_reason
        assert s.logprobs == pytest.approx(p.logprobs, abs=1e-4)
        assert [ids for ids, _ in s.top_logprobs] == [ids for ids, _ in p.top_logprobs]
    # Nothing of an opted-out request is speculated.
    before = _spec_counters(port)
    generate_many(ch, [r | {"speculative": False, "temperature": 0.0} for r in _requests(3, 4, 20)])
    assert _spec_counters(port)[:3] == before[:3]


def test_stop_strings_inside_accepted_runs_cut_the_text_as_without_speculation(tiny_model_dir, ngram_services):
    _, ch, _ = ngram_services
    from scheduler_svc.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    cases = []
    for req in _requests(4, 4, 40):
        output = hf_greedy(tiny_model_dir, req["token_ids"], 40)
        for at in (6, 13, 21):
            stop = tokenizer.decode(output[at:at + 2]).strip()
            if stop:
                cases.append(req | {"stop": [stop]})
    speculative = generate_many(ch, cases)
    plain = generate_many(ch, [c | {"speculative": False} for c in cases])
    for s, p in zip(speculative, plain):
        assert (s.token_ids, s.text, s.finish_reason, s.matched_stop) == \
            (p.token_ids, p.text, p.finish_reason, p.matched_stop)
    assert sum(s.finish_reason == generation_pb2.FINISH_REASON_STOP for s in speculative) >= len(cases) // 2


def test_an_aborted_stream_gives_back_every_block(ngram_services):
    _, ch, _ = ngram_services
    stub = generation_pb2_grpc.GenerationStub(ch)
    req = _requests(5, 1, 400)[0]
    call = stub.Generate(generation_pb2.GenerateRequest(
        request_id="spec-abort", token_ids=generation_pb2.TokenIds(ids=req["token_ids"]),
        sampling=generation_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400)), timeout=60)
    received, aborted = [], False
    for msg in call:
        received += msg.token_ids
        if len(received) >= 10 and not aborted:
            aborted = stub.Abort(generation_pb2.AbortRequest(request_id="spec-abort"), timeout=10).found
            assert aborted
        if msg.finish_reason:
            assert msg.finish_reason == generation_pb2.FINISH_REASON_ABORT
    assert 10 <= len(received) < 400
    deadline = time.monotonic() + 10
    while model_info(ch).worker_groups[0].num_free_kv_blocks != model_info(ch).num_kv_blocks:
        assert time.monotonic() < deadline, "blocks still held after the abort"
        time.sleep(0.05)


def test_preemption_with_speculation_matches_transformers(tiny_model_dir, launch_services):
    requests = _requests(6, 16, 24)
    with launch_services(worker_args=(*NGRAM, "--num-kv-blocks", "20"),
                         scheduler_args=("--speculative-max-batch-size", "16")) as svc, svc.channel() as ch:
        completions = generate_many(ch, requests)
        info = model_info(ch)
    assert info.worker_groups[0].num_preemptions > 0
    assert info.worker_groups[0].num_free_kv_blocks == 20
    for i, (req, got) in enumerate(zip(requests, completions)):
        assert got.token_ids == hf_greedy(tiny_model_dir, req["token_ids"], 24), f"request {i}"


def test_a_worker_restart_mid_speculation_loses_and_repeats_no_token(tiny_model_dir, tmp_path):
    requests = _requests(7, 6, 80)
    with running_services(tiny_model_dir, tmp_path / "logs", worker_args=NGRAM) as svc, svc.channel() as ch:
        undisturbed = generate_many(ch, requests)
        run = stream_across_a_worker_restart(svc, ch, tiny_model_dir, tmp_path / "logs", requests, NGRAM,
                                             started_after=10)
    for i, (tokens, _) in enumerate(run.streams):
        assert tokens == undisturbed[i].token_ids, f"stream {i} lost or repeated tokens across the restart"


def test_a_scheduler_asking_for_a_method_its_workers_lack_says_so(tiny_model_dir, tmp_path):
    worker = worker_proc(tiny_model_dir, tmp_path, *NGRAM).start()
    scheduler = scheduler_proc(tiny_model_dir, tmp_path, [worker.addr], "--speculative-method", "eagle3")
    try:
        worker.wait_serving()
        scheduler.start()
        deadline = time.monotonic() + 60
        while "--speculative-method eagle3, but the workers of group 0" not in scheduler.log.read_text():
            assert time.monotonic() < deadline, scheduler.log.read_text()[-2000:]
            time.sleep(0.2)
    finally:
        scheduler.stop()
        worker.stop()
