"""The typed client (common/client/), sync and asyncio, against a real scheduler and worker."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from common.client import (AsyncClient, Client, Completion, CompletionChunk, RequestError, SamplingParams,
                           Usage)
from tests.support.certs import make_ca_and_certs
from tests.support.procs import REPO, Proc, free_port, worker_proc

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(services):
    with Client(services.scheduler_addr, timeout=240) as c:
        yield c


def test_generate_returns_the_whole_completion_and_equals_the_stream(client):
    out = client.generate("Once upon a time", max_tokens=12, temperature=0, ignore_eos=True)
    assert isinstance(out, Completion)
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert isinstance(out.usage, Usage) and out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    assert out.logprobs is None and out.request_id

    chunks = list(client.stream("Once upon a time", max_tokens=12, temperature=0, ignore_eos=True))
    assert all(isinstance(c, CompletionChunk) for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1) and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage is not None and all(c.usage is None for c in chunks[:-1])
    assert sum((c.token_ids for c in chunks), []) == out.token_ids
    assert "".join(c.text for c in chunks) == out.text


def test_token_id_prompts_logprobs_and_sampling_params_with_overrides(client):
    base = SamplingParams(max_tokens=5, temperature=0.8, seed=7, ignore_eos=True, logprobs=True)
    first = client.generate([3, 4, 5, 6], base)
    again = client.generate([3, 4, 5, 6], base, max_tokens=5)          # keywords override the dataclass
    assert first.token_ids == again.token_ids and first.usage.prompt_tokens == 4
    assert first.logprobs is not None and len(first.logprobs) == 5 and all(lp <= 0 for lp in first.logprobs)
    shorter = client.generate([3, 4, 5, 6], base, max_tokens=2)
    assert shorter.token_ids == first.token_ids[:2]
    with pytest.raises(TypeError, match="sampling options are: max_tokens"):
        client.generate("hi", max_token=3)


def test_errors_carry_the_status_name_and_the_field(client):
    with pytest.raises(RequestError) as err:
        client.generate("hi", top_p=1.5, max_tokens=2)
    assert err.value.code == "INVALID_ARGUMENT" and "top_p" in err.value.message
    with pytest.raises(RequestError) as err:
        client.generate("hi", max_tokens=4000, ignore_eos=True, timeout=0.05)
    assert err.value.code == "DEADLINE_EXCEEDED"


def _wait_until_idle(client: Client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(g.num_running for g in client.model_info().worker_groups):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def test_leaving_a_stream_early_cancels_the_request(client):
    stream = client.stream("a long one", max_tokens=4000, ignore_eos=True)
    assert next(stream).token_ids
    stream.close()
    _wait_until_idle(client)


def test_abort_ends_a_running_request_and_says_whether_it_knew_it(client):
    chunks: list[CompletionChunk] = []
    started = threading.Event()

    def run() -> None:
        for chunk in client.stream("abort me", max_tokens=4000, ignore_eos=True, request_id="client-abort-1"):
            chunks.append(chunk)
            started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    assert client.abort("client-abort-1") is True
    thread.join(60)
    assert chunks[-1].finish_reason == "abort"
    assert client.abort("client-abort-1") is False


def test_model_info_is_a_dataclass_of_the_server_facts(client):
    info = client.model_info()
    assert info.model and info.max_model_len > 0 and info.vocab_size > 0 and info.eos_token_ids
    [group] = info.worker_groups
    assert group.healthy and group.device == "cpu" and group.tensor_parallel_size == 1
    assert 0 <= group.num_free_kv_blocks <= group.num_kv_blocks


def test_async_client_matches_the_sync_one_for_concurrent_requests(client, services):
    prompts = ["alpha", "beta gamma", "delta epsilon zeta"]
    expected = [client.generate(p, max_tokens=6, temperature=0, ignore_eos=True).token_ids for p in prompts]

    async def main():
        async with AsyncClient(services.scheduler_addr, timeout=60) as aclient:
            await aclient.wait_ready(30)
            outs = await asyncio.gather(*(aclient.generate(p, max_tokens=6, temperature=0, ignore_eos=True)
                                          for p in prompts))
            streamed = [c async for c in aclient.stream(prompts[0], max_tokens=6, temperature=0, ignore_eos=True)]
            info = await aclient.model_info()
            found = await aclient.abort("nothing-by-this-id")
            with pytest.raises(RequestError) as err:
                await aclient.generate("", max_tokens=2)
            return outs, streamed, info, found, err.value.code

    outs, streamed, info, found, code = asyncio.run(main())
    assert [o.token_ids for o in outs] == expected
    assert sum((c.token_ids for c in streamed), []) == expected[0] and streamed[-1].finish_reason == "length"
    assert info.worker_groups and found is False and code == "INVALID_ARGUMENT"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_with_a_ca_file_and_a_bearer_token(tiny_model_dir, tmp_path):
    certs = make_ca_and_certs(tmp_path / "certs", names=("server",))
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    worker = worker_proc(tiny_model_dir, log_dir).start()
    port = free_port()
    scheduler = Proc("scheduler", f"127.0.0.1:{port}",
                     ["scheduler_svc", "--model", str(tiny_model_dir), "--workers", worker.addr, "--host", "127.0.0.1",
                      "--port", str(port), "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                      "--auth-token-file", str(token_file)], log_dir / "scheduler.log")
    try:
        worker.wait_serving()
        scheduler.start()
        with Client(f"localhost:{port}", ca_file=certs / "ca.pem", token_file=token_file) as c:
            c.wait_ready(120)
            assert c.generate("hi", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        # The probe a Kubernetes pod runs against its own TLS-only scheduler (deploy/k8s/scheduler-tls.yaml).
        probe = subprocess.run([sys.executable, "-m", "common.healthcheck", f"127.0.0.1:{port}", "--tls-ca",
                                str(certs / "ca.pem"), "--tls-server-name", "localhost"], cwd=REPO,
                               capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0 and probe.stdout.strip().endswith("SERVING"), probe
        with Client(f"localhost:{port}", ca_file=certs / "ca.pem") as no_token:
            with pytest.raises(RequestError) as err:
                no_token.generate("hi", max_tokens=2)
            assert err.value.code == "UNAUTHENTICATED"
        with Client(f"localhost:{port}", timeout=5) as plaintext:
            with pytest.raises(RequestError) as err:
                plaintext.model_info()
            assert err.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    finally:
        scheduler.stop()
        worker.stop()


def test_settings_that_cannot_work_are_refused_before_connecting(tmp_path):
    with pytest.raises(ValueError, match="client_cert and client_key go together"):
        Client("127.0.0.1:1", client_cert=tmp_path / "c.pem")
    with pytest.raises(ValueError, match="not both"):
        Client("127.0.0.1:1", token="a", token_file=tmp_path / "t")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty token"):
        Client("127.0.0.1:1", token_file=tmp_path / "empty")


def test_the_generate_command_streams_a_completion_and_reports_refusals(services):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tools.generate", "--target", services.scheduler_addr, *args],
                              cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=60)

    ok = run("Once upon a time", "--max-tokens", "5")
    assert ok.returncode == 0, ok.stderr
    assert re.search(r"\n\[(length|stop): \d+ prompt tokens, [1-5] generated, \d+ cached\]$", ok.stdout), ok.stdout
    refused = run("hi", "--top-p", "2")
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr and "top_p" in refused.stderr
    biased = run("hi", "--max-tokens", "3", "--logit-bias", "5=100", "9=-100")
    with Client(services.scheduler_addr) as direct:
        want = direct.generate("hi", max_tokens=3, temperature=0, logit_bias={5: 100, 9: -100})
    assert biased.returncode == 0, biased.stderr
    assert want.token_ids == [5, 5, 5] and biased.stdout.startswith(want.text), (biased.stdout, want.text)
    bad = run("hi", "--logit-bias", "5:100")
    assert bad.returncode == 2 and "expected ID=BIAS" in bad.stderr


def test_samples_logprobs_constraints_and_matched_stop(client):
    out = client.generate([7, 8, 9, 10], n=3, temperature=1.0, seed=2, max_tokens=4, ignore_eos=True, top_logprobs=2,
                          prompt_logprobs=True)
    assert [s.index for s in out.samples] == [0, 1, 2] and out.samples[0] is not out and out.index == 0
    assert out.token_ids == out.samples[0].token_ids and len(out.top_logprobs) == 4 == len(out.logprobs)
    assert all(len(ids) == 2 == len(values) for ids, values in out.top_logprobs)
    assert len(out.prompt_logprobs) == 3 and len(out.prompt_top_logprobs) == 3
    assert out.samples[1].prompt_logprobs is None
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constrained = client.generate("Answer:", json_schema=schema, temperature=0, max_tokens=40)
    assert constrained.finish_reason == "stop" and constrained.matched_stop in ("<|im_end|>", "<|endoftext|>")
    assert json.loads(constrained.text.removesuffix(constrained.matched_stop)) in ({"ok": True}, {"ok": False})
    with pytest.raises(ValueError, match="give one constraint"):
        client.generate("x", regex="a", grammar='root ::= "a"')


def test_chat_tokenize_and_detokenize(client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}}}]
    turn = client.chat([{"role": "user", "content": "1 + 1?"}], tools=tools, tool_choice="add", temperature=0,
                       max_tokens=100)
    assert turn.finish_reason == "tool_calls" and [c.name for c in turn.tool_calls] == ["add"]
    assert 0 <= turn.tool_calls[0].arguments["a"] <= 9
    again = client.chat([{"role": "user", "content": "1 + 1?"},
                         {"role": "assistant", "tool_calls": [{"id": turn.tool_calls[0].id, "function": {
                             "name": "add", "arguments": turn.tool_calls[0].arguments}}]},
                         {"role": "tool", "tool_call_id": turn.tool_calls[0].id, "content": "2"}],
                        tools=tools, max_tokens=5, enable_thinking=False)
    assert again.usage.prompt_tokens > turn.usage.prompt_tokens
    ids = client.tokenize("Hello world")
    assert ids and client.detokenize(ids) == "Hello world"
    # Each token's own text in one call; a piece of a multi-byte character alone is U+FFFD.
    assert client.token_texts(ids) == [client.detokenize([i]) for i in ids]
    assert "".join(client.token_texts(ids)) == "Hello world"
    pieces = client.tokenize("ü€😀")
    each = client.token_texts(pieces)
    assert each == [client.detokenize([i]) for i in pieces] and "\ufffd" in each
    assert client.token_texts([]) == []
    with pytest.raises(RequestError, match=r"token_ids\[1\] = 1000000 is out of range") as caught:
        client.token_texts([5, 1_000_000])
    assert caught.value.code == "INVALID_ARGUMENT"


def test_chat_logprobs_cover_every_token_and_health_answers(client):
    messages = [{"role": "user", "content": "Hi"}]
    turn = client.chat(messages, temperature=0, max_tokens=6, top_logprobs=2)
    assert len(turn.logprobs) == len(turn.top_logprobs) == len(turn.token_ids) == turn.usage.completion_tokens
    for logprob, (ids, values) in zip(turn.logprobs, turn.top_logprobs):
        assert len(ids) == len(values) == 2 and logprob == pytest.approx(values[0])   # greedy: the top token
    chunks = list(client.stream_chat(messages, temperature=0, max_tokens=6, logprobs=True))
    # abs: the second turn finds the prompt in the prefix cache, a different sum order
    assert [lp for c in chunks for lp in c.logprobs] == pytest.approx(turn.logprobs, abs=1e-4)
    assert all(c.top_logprobs is None for c in chunks)
    assert client.chat(messages, temperature=0, max_tokens=2).logprobs is None   # not asked for
    assert client.health() == "SERVING"
