"""Checks the containerised service from the outside, against the same service run without Docker.

    python -m tools.docker_smoke compare  --target HOST:PORT --reference HOST:PORT
    python -m tools.docker_smoke failover --target HOST:PORT --reference HOST:PORT \\
        --kill-cmd "docker compose kill worker" --start-cmd "docker compose start worker"

`compare` sends the same requests (greedy, and seeded sampling) to both services, one at a time
so batching cannot differ, and requires identical tokens and text (and, with --expect-groups N,
N healthy worker groups behind the target). `failover` kills the
target's worker during a long request, requires the scheduler to report the worker group
unhealthy, starts the worker again, requires the group healthy again and a greedy answer equal
to the reference's. Exits 0 when every check passes; prints one line per check.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1 import generation_pb2_grpc as pb_grpc

REQUEST_TIMEOUT_S = 120.0


class CheckFailed(Exception):
    pass


@dataclass
class Answer:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    error: str = ""                 # the status code when the stream ended in an error

    def summary(self) -> str:
        end = self.error or self.finish_reason or "unfinished"
        return f"{len(self.token_ids)} tokens, {end}"


class Service:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def model_info(self, timeout_s: float = 5.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)

    def generate(self, request: pb.GenerateRequest, on_token: Callable[[int], None] | None = None) -> Answer:
        """Runs one stream to its end; an error status ends the answer instead of raising."""
        answer = Answer()
        try:
            for message in self.stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
                answer.token_ids += message.token_ids
                answer.text += message.text
                if message.finish_reason:
                    answer.finish_reason = pb.FinishReason.Name(message.finish_reason)
                if on_token:
                    on_token(len(answer.token_ids))
        except grpc.RpcError as err:
            answer.error = err.code().name
        return answer


def wait_until(what: str, predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> float:
    """Polls until predicate() holds; returns the seconds it took. RPC errors count as 'not yet'."""
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except grpc.RpcError:
            pass
        if time.monotonic() - start > timeout_s:
            raise CheckFailed(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def groups_healthy(service: Service) -> list[bool]:
    return [group.healthy for group in service.model_info().worker_groups]


def test_requests(info: pb.ModelInfo, seed: int) -> list[pb.GenerateRequest]:
    """Text prompts and fresh random token-id prompts, greedy and seeded-sampled."""
    rng = random.Random(seed)
    greedy = dict(temperature=0.0, max_tokens=24)
    requests = [
        pb.GenerateRequest(text="Hello world! Once upon a time", sampling=pb.SamplingParams(**greedy)),
        pb.GenerateRequest(text="The quick brown fox", sampling=pb.SamplingParams(**greedy, ignore_eos=True)),
        pb.GenerateRequest(text="Readability counts.",
                           sampling=pb.SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(2**32),
                                                      max_tokens=24, ignore_eos=True)),
    ]
    for length in (rng.randint(2, 16), rng.randint(40, 200)):
        ids = [rng.randrange(info.vocab_size) for _ in range(length)]
        requests.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                           sampling=pb.SamplingParams(**greedy, ignore_eos=True)))
    return requests


def compare(target: Service, reference: Service, seed: int, expect_groups: int | None) -> None:
    info, ref_info = target.model_info(), reference.model_info()
    for name in ("model", "vocab_size", "max_model_len", "eos_token_ids", "block_size"):
        if getattr(info, name) != getattr(ref_info, name):
            raise CheckFailed(f"ModelInfo.{name} differs: {getattr(info, name)} vs {getattr(ref_info, name)}")
    healthy = [group.healthy for group in info.worker_groups]
    if expect_groups is not None and (len(healthy) != expect_groups or not all(healthy)):
        raise CheckFailed(f"expected {expect_groups} healthy worker groups, the target has {healthy} "
                          f"({[list(group.addresses) for group in info.worker_groups]})")
    print(f"ok   model info matches ({info.model}, vocab {info.vocab_size}, "
          f"{sum(healthy)} of {len(healthy)} worker group(s) healthy)")
    for i, request in enumerate(test_requests(info, seed)):
        got, want = target.generate(request), reference.generate(request)
        if got.error or want.error:
            raise CheckFailed(f"request {i}: target {got.summary()}, reference {want.summary()}")
        if (got.token_ids, got.text, got.finish_reason) != (want.token_ids, want.text, want.finish_reason):
            raise CheckFailed(f"request {i} differs:\n  target    {got.token_ids} {got.text!r}\n"
                              f"  reference {want.token_ids} {want.text!r}")
        print(f"ok   request {i} identical ({got.summary()})")


def failover(target: Service, reference: Service, kill_cmd: str, start_cmd: str,
             long_tokens: int, recovery_timeout_s: float) -> None:
    wait_until("the target's worker groups to be healthy", lambda: all(groups_healthy(target)), 60)
    long_request = pb.GenerateRequest(text="Once upon a time", sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=long_tokens, ignore_eos=True))
    streaming = threading.Event()
    result: list[Answer] = []

    def run_long_request() -> None:
        result.append(target.generate(long_request, on_token=lambda n: n >= 4 and streaming.set()))
        streaming.set()

    thread = threading.Thread(target=run_long_request, daemon=True)
    thread.start()
    if not streaming.wait(REQUEST_TIMEOUT_S) or result:
        raise CheckFailed(f"the long request ended before the worker was killed ({result[0].summary()})"
                          if result else "the long request produced no tokens")
    subprocess.run(shlex.split(kill_cmd), check=True, stdout=subprocess.DEVNULL)
    took = wait_until("the scheduler to report the killed worker unhealthy",
                      lambda: not all(groups_healthy(target)), 30, poll_s=0.2)
    print(f"ok   worker killed during a request; scheduler reported it unhealthy after {took:.1f}s")

    subprocess.run(shlex.split(start_cmd), check=True, stdout=subprocess.DEVNULL)
    took = wait_until("the restarted worker to be healthy again", lambda: all(groups_healthy(target)),
                      recovery_timeout_s)
    print(f"ok   worker restarted; scheduler reported it healthy after {took:.1f}s")

    thread.join(REQUEST_TIMEOUT_S)
    if thread.is_alive():
        raise CheckFailed("the request in flight during the kill never ended")
    interrupted = result[0]
    if interrupted.error or interrupted.finish_reason == "FINISH_REASON_ABORT":
        print(f"ok   the request in flight ended cleanly ({interrupted.summary()})")
    else:
        # The scheduler carried it over to the restarted worker: the tokens must be the same.
        want = reference.generate(long_request)
        if interrupted.token_ids != want.token_ids:
            raise CheckFailed(f"the request carried over the restart differs from the reference "
                              f"({interrupted.summary()} vs {want.summary()})")
        print(f"ok   the request in flight survived the restart, identical to the reference ({interrupted.summary()})")

    request = pb.GenerateRequest(text="Hello world!", sampling=pb.SamplingParams(temperature=0.0, max_tokens=24))
    got, want = target.generate(request), reference.generate(request)
    if got.error or got.token_ids != want.token_ids:
        raise CheckFailed(f"after recovery: target {got.summary()} {got.token_ids}, reference {want.token_ids}")
    print(f"ok   serves again after recovery, identical to the reference ({got.summary()})")


def _http(url: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def gateway(url: str, reference: Service, seed: int) -> None:
    """The OpenAI-compatible gateway in front of the target: healthy, naming the model, and its
    greedy completions (plain and streamed) equal to the reference's Generate text."""
    info = reference.model_info()
    wait_until(f"{url}/health to answer 200", lambda: _http(f"{url}/health", timeout_s=5)[0] == 200, 120)
    status, body = _http(f"{url}/v1/models")
    models = [m["id"] for m in json.loads(body)["data"]] if status == 200 else body
    if models != [info.model]:
        raise CheckFailed(f"/v1/models: {status} {models}, expected [{info.model!r}]")
    print(f"ok   gateway healthy, /v1/models lists {info.model}")
    rng = random.Random(seed)
    prompts = ["Hello world! Once upon a time", " ".join(str(rng.randrange(1000)) for _ in range(rng.randint(3, 30)))]
    for prompt in prompts:
        want = reference.generate(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, skip_special_tokens=True)))
        request = {"model": info.model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        status, body = _http(f"{url}/v1/completions", request)
        if status != 200:
            raise CheckFailed(f"/v1/completions answered {status}: {body[:300]!r}")
        text = json.loads(body)["choices"][0]["text"]
        status, body = _http(f"{url}/v1/completions", {**request, "stream": True})
        events = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
        if status != 200 or not events or events[-1] != b"[DONE]":
            raise CheckFailed(f"streamed /v1/completions answered {status}: {body[:300]!r}")
        streamed = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
        if not (text == streamed == want.text):
            raise CheckFailed(f"completion of {prompt!r} differs:\n  gateway   {text!r}\n  streamed  {streamed!r}\n"
                              f"  reference {want.text!r}")
        print(f"ok   gateway completion identical, plain and streamed ({len(text)} characters)")
    status, body = _http(f"{url}/v1/completions", {"model": info.model, "prompt": "x", "temperature": -1})
    if status != 400 or "temperature" not in body.decode():
        raise CheckFailed(f"a negative temperature got {status} {body[:300]!r}, expected a 400 naming it")
    print("ok   gateway refuses a bad parameter with a 400 naming it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docker_smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("compare", "failover"):
        p = sub.add_parser(name)
        p.add_argument("--target", required=True, help="the service under test, HOST:PORT")
        p.add_argument("--reference", required=True, help="the same model served without Docker, HOST:PORT")
        p.add_argument("--ready-timeout", type=float, default=120.0)
    cmp = sub.choices["compare"]
    cmp.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh)")
    cmp.add_argument("--expect-groups", type=int, default=None, help="require this many healthy worker groups")
    fo = sub.choices["failover"]
    fo.add_argument("--kill-cmd", required=True, help="kills the target's worker, e.g. 'docker compose kill worker'")
    fo.add_argument("--start-cmd", required=True, help="starts it again, e.g. 'docker compose start worker'")
    fo.add_argument("--long-tokens", type=int, default=600, help="length of the request in flight during the kill")
    fo.add_argument("--recovery-timeout", type=float, default=180.0)
    gw = sub.add_parser("gateway", help="checks the OpenAI-compatible gateway against the reference")
    gw.add_argument("--url", required=True, help="the gateway's base URL, http://HOST:PORT")
    gw.add_argument("--reference", required=True, help="the same model served without Docker, HOST:PORT")
    gw.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh)")
    args = parser.parse_args(argv)
    if args.command == "gateway":
        try:
            gateway(args.url.rstrip("/"), Service(args.reference),
                    args.seed if args.seed is not None else random.randrange(2**31))
        except CheckFailed as err:
            print(f"FAIL {err}")
            return 1
        return 0

    target, reference = Service(args.target), Service(args.reference)
    try:
        for service in (target, reference):
            wait_until(f"{service.address} to answer GetModelInfo", lambda s=service: bool(s.model_info()),
                       args.ready_timeout)
        if args.command == "compare":
            seed = args.seed if args.seed is not None else random.randrange(2**31)
            print(f"prompt seed {seed}")
            compare(target, reference, seed, args.expect_groups)
        else:
            failover(target, reference, args.kill_cmd, args.start_cmd, args.long_tokens, args.recovery_timeout)
    except CheckFailed as err:
        print(f"FAIL {err}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
