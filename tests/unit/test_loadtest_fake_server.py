"""The load test against a fake in-process Generation server (grpc.aio) that streams tokens with
small delays, refuses some calls with UNAVAILABLE and stalls one past the client's deadline."""
from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import shutil
import threading

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1 import generation_pb2_grpc as pb_grpc
from tests.support.certs import make_ca_and_certs
from tools.loadtest.__main__ import main

VOCAB = 97
BLOCK = 8
TOKEN = "secret-token"


class FakeGeneration(pb_grpc.GenerationServicer):
    """Streams max_tokens tokens in messages of alternately 1 and 2 tokens (so ITL sees k > 1) and
    reports as cached the whole blocks a prompt shares with any earlier prompt."""

    def __init__(self, *, fail_every: int | None = None, slow_call: int | None = None, token_delay_s: float = 0.002):
        self.fail_every, self.slow_call, self.token_delay_s = fail_every, slow_call, token_delay_s
        self.calls = self.in_flight = self.max_in_flight = 0
        self.seen_prompts: list[list[int]] = []
        self.request_ids: list[str] = []

    async def _check_auth(self, context) -> None:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {TOKEN}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing bearer token")

    async def GetModelInfo(self, request, context):
        await self._check_auth(context)
        return pb.ModelInfo(model="fake-qwen3", max_model_len=4096, vocab_size=VOCAB, block_size=BLOCK)

    def _cached_tokens(self, ids: list[int]) -> int:
        def common(a, b):
            return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        longest = max((common(ids, seen) for seen in self.seen_prompts), default=0)
        return longest // BLOCK * BLOCK

    async def Generate(self, request, context):
        await self._check_auth(context)
        index = self.calls
        self.calls += 1
        self.request_ids.append(request.request_id)
        if self.fail_every and index % self.fail_every == self.fail_every - 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake server overloaded")
        if request.HasField("token_ids"):
            ids = list(request.token_ids.ids)
            if any(i >= VOCAB for i in ids):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token id out of vocab")
        else:
            ids = list(request.text.encode())  # the fake's "tokenizer": one token per byte
        cached = self._cached_tokens(ids)
        self.seen_prompts.append(ids)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if index == self.slow_call:
                await asyncio.sleep(30)  # the client's deadline cancels this first
            total, sent, size = request.sampling.max_tokens, 0, 1
            while sent < total:
                k = min(size, total - sent)
                await asyncio.sleep(self.token_delay_s * k)
                sent, size = sent + k, 3 - size
                last = sent == total
                yield pb.GenerateResponse(
                    request_id=request.request_id,
                    token_ids=list(range(sent - k, sent)),
                    finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                    usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=total, cached_prompt_tokens=cached)
                    if last else None,
                )
        finally:
            self.in_flight -= 1


@contextlib.contextmanager
def serving(servicer: FakeGeneration, certs: pathlib.Path | None = None):
    """Runs a grpc.aio server on its own event loop in a thread, since main() runs its own loop;
    with certs (a tests.support.certs directory) it serves TLS only."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        if certs is None:
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            key_pair = ((certs / "server.key").read_bytes(), (certs / "server.pem").read_bytes())
            port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([key_pair]))
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def run_cli(target: str, *args: str) -> int:
    return main(["--target", target, "--token", TOKEN, "--seed", "1", *args])


def test_failures_are_counted_by_code_and_the_run_completes(tmp_path, capsys):
    fake = FakeGeneration(fail_every=4, slow_call=2)
    json_path, plot_path = tmp_path / "run.json", tmp_path / "run.png"
    with serving(fake) as target:
        rc = run_cli(target, "--num-prompts", "12", "--input-len", "16", "--output-len", "6", "--range-ratio", "0.5",
                     "--timeout", "1", "--goodput", "ttft:1000", "e2el:1500",
                     "--save-json", str(json_path), "--plot", str(plot_path))
    out = capsys.readouterr().out
    print(out)
    assert rc == 0
    # Calls 3, 7 and 11 are refused; call 2 stalls past the 1 s deadline.
    assert "UNAVAILABLE 3" in out and "DEADLINE_EXCEEDED 1" in out
    saved = json.loads(json_path.read_text())
    summary, requests = saved["runs"][0]["summary"], saved["runs"][0]["requests"]
    assert (summary["completed"], summary["failed"]) == (8, 4)
    assert summary["failed_by_code"] == {"UNAVAILABLE": 3, "DEADLINE_EXCEEDED": 1}
    assert summary["request_rate"] == "inf" and summary["goodput"] is not None
    assert len(requests) == 12 and len({r["request_id"] for r in requests}) == 12
    assert saved["settings"]["server"]["model"] == "fake-qwen3" and "token" not in saved["settings"]
    done = [r for r in requests if r["status"] == "OK"]
    for r in done:
        assert r["output_tokens"] == r["requested_tokens"] and 3 <= r["requested_tokens"] <= 9
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert len(r["itls_s"]) == len(r["message_tokens"]) - 1 and all(gap > 0 for gap in r["itls_s"])
        assert r["message_tokens"][:2] == [1, 2][: len(r["message_tokens"])]
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert summary["itl"]["count"] == sum(len(r["itls_s"]) for r in done)
    timed_out = next(r for r in requests if r["status"] == "DEADLINE_EXCEEDED")
    assert timed_out["e2e_s"] >= 1.0 and timed_out["output_tokens"] == 0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_request_rate_with_a_concurrency_limit(tmp_path):
    fake = FakeGeneration()
    json_path = tmp_path / "run.json"
    with serving(fake) as target:
        rc = run_cli(target, "--num-prompts", "20", "--input-len", "8", "--output-len", "8", "--request-rate", "200",
                     "--burstiness", "0.5", "--max-concurrency", "3", "--num-warmups", "2", "--disable-tqdm",
                     "--save-json", str(json_path))
    assert rc == 0
    assert fake.calls == 22 and fake.max_in_flight <= 3
    run = json.loads(json_path.read_text())["runs"][0]
    assert run["summary"]["completed"] == 20 and run["summary"]["request_rate"] == 200.0
    # Warm-up requests are sent but never measured.
    assert sum("warmup" in rid for rid in fake.request_ids) == 2
    assert not any("warmup" in r["request_id"] for r in run["requests"])


def test_shared_prefix_dataset_reports_the_prefix_cache_hit_rate(tmp_path, capsys):
    fake = FakeGeneration()
    json_path = tmp_path / "run.json"
    with serving(fake) as target:
        rc = run_cli(target, "--dataset", "shared-prefix", "--prefix-groups", "2", "--prefix-len", str(2 * BLOCK),
                     "--input-len", "4", "--output-len", "3", "--num-prompts", "8", "--save-json", str(json_path))
    assert rc == 0
    summary = json.loads(json_path.read_text())["runs"][0]["summary"]
    # The first prompt of each group misses; the other 6 find their group's 16-token prefix cached.
    assert summary["total_prompt_tokens"] == 8 * 20 and summary["cached_prompt_tokens"] == 6 * 16
    assert summary["prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert "60.0%" in capsys.readouterr().out


def test_sweep_writes_one_table_and_one_plot(tmp_path, capsys):
    fake = FakeGeneration()
    json_path, plot_path = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with serving(fake) as target:
        rc = run_cli(target, "--sweep", "100,inf", "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                     "--disable-tqdm", "--save-json", str(json_path), "--plot", str(plot_path))
    assert rc == 0
    table = capsys.readouterr().out.split("TTFT p50")[-1]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert [row[:3] for row in rows] == [["100", "6", "0"], ["inf", "6", "0"]]
    runs = json.loads(json_path.read_text())["runs"]
    assert [run["summary"]["request_rate"] for run in runs] == [100.0, "inf"]
    # Each rate gets fresh prompts, so no run hits what an earlier one cached.
    assert all(run["summary"]["cached_prompt_tokens"] == 0 for run in runs)
    assert len(set(fake.request_ids)) == 12
    assert plot_path.read_bytes()[:4] == b"\x89PNG"


def test_jsonl_prompts_are_sent_as_text(tmp_path):
    fake = FakeGeneration()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello", "max_tokens": 2}\n{"prompt": "How are you?"}\n')
    json_path = tmp_path / "run.json"
    with serving(fake) as target:
        rc = run_cli(target, "--dataset", "jsonl", "--dataset-path", str(prompts), "--num-prompts", "4",
                     "--output-len", "5", "--disable-tqdm", "--save-json", str(json_path))
    assert rc == 0
    requests = json.loads(json_path.read_text())["runs"][0]["requests"]
    assert sorted((r["prompt_tokens"], r["output_tokens"]) for r in requests) == [(5, 2), (5, 2), (12, 5), (12, 5)]


def test_missing_token_fails_before_sending(capsys):
    fake = FakeGeneration()
    with serving(fake) as target:
        rc = main(["--target", target, "--num-prompts", "2"])
    assert rc == 2 and fake.calls == 0
    assert "UNAUTHENTICATED" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_target_with_a_private_ca(tmp_path):
    certs = make_ca_and_certs(tmp_path / "certs", names=("server",))
    fake = FakeGeneration()
    with serving(fake, certs) as target:
        assert run_cli(target, "--tls-ca", str(certs / "ca.pem"), "--num-prompts", "2", "--output-len", "2",
                       "--input-len", "4", "--disable-tqdm") == 0
        assert fake.calls == 2
        # The same server refuses a plaintext client before any request is made.
        assert run_cli(target, "--num-prompts", "1", "--timeout", "5") == 2
    assert fake.calls == 2
