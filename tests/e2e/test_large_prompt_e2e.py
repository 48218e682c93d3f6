"""A 1 MiB text prompt does not pause the other streams (real processes): while it is tokenized
(a second or more of work), each of four running streams keeps receiving tokens, in the first half
of its admission already (a paused event loop delivers nothing until it is free again, then all at
once), however busy the machine. The context is long enough (67k tokens) that the text passes the
byte bound and must be tokenized; it is then refused by its token count, as a prompt of 500k
tokens should be. How much the other streams slow down is measured as a ratio by the soak's
hostile phase (tools/loadtest/hostile.py), not here."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from common.tiny_model import write_tiny_qwen3
from tests.support.procs import running_services

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS = 4
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "serving", "tokens")


def one_mib_of_text() -> str:
    words = (WORDS[(i * 7 + i // 3) % len(WORDS)] for i in range(1 << 20))
    text = " ".join(words)
    return text[: 1 << 20]


class Streams:
    """NUM_STREAMS long greedy streams; each token's arrival time is recorded."""

    def __init__(self, channel: grpc.Channel) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        self.calls = [stub.Generate(generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=[10 + i, 20, 30, 40]),
            sampling=generation_pb2.SamplingParams(max_tokens=60000, ignore_eos=True, temperature=0.0)),
            timeout=150) for i in range(NUM_STREAMS)]
        self.arrivals: list[list[float]] = [[] for _ in self.calls]
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(NUM_STREAMS)]
        for t in self.threads:
            t.start()

    def _read(self, i: int) -> None:
        try:
            for _ in self.calls[i]:
                self.arrivals[i].append(time.monotonic())
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, e

    def tokens_between(self, start: float, end: float) -> list[int]:
        """How many tokens each stream received within [start, end]."""
        return [sum(start <= t <= end for t in times) for times in self.arrivals]

    def stop(self) -> None:
        for call in self.calls:
            call.cancel()
        for t in self.threads:
            t.join(10)


def test_a_one_mib_prompt_does_not_pause_the_other_streams(tmp_path):
    model = write_tiny_qwen3(tmp_path / "long-context-tiny", max_position_embeddings=131072)
    text = one_mib_of_text()
    with running_services(model, tmp_path / "logs", worker_args=("--num-kv-blocks", "4200")) as svc, \
            svc.channel() as ch:
        streams = Streams(ch)
        try:
            while min(len(a) for a in streams.arrivals) < 20:    # all four decoding
                time.sleep(0.05)
            sent = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                    text=text, sampling=generation_pb2.SamplingParams(max_tokens=1)), timeout=60).next()
            answered = time.monotonic()
        finally:
            streams.stop()
    # It was tokenized (not refused by its byte length), and then refused by its token count.
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens" in refused.value.details() and "max_model_len" in refused.value.details()
    first_half = streams.tokens_between(sent, sent + (answered - sent) / 2)
    print(f"admitted in {answered - sent:.2f} s; tokens per stream in its first half: {first_half}")
    assert all(count >= 1 for count in first_half), f"a stream got no token while the prompt was admitted: {first_half}"
