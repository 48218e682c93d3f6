"""A 1 MiB text prompt does not pause the other streams (real processes): while it is tokenized
(about a second of work), the worst gap between two tokens of four running streams stays within a
small multiple of their worst gap without it, measured in the same run. The context is long enough
(67k tokens) that the text passes the byte bound and must be tokenized; it is then refused by its
token count, as a prompt of 500k tokens should be."""
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

    def worst_gap(self, start: float, end: float) -> float:
        gaps = [b - a for times in self.arrivals for a, b in zip(times, times[1:]) if start <= b and a <= end]
        assert len(gaps) > 20, f"too few tokens between {start} and {end}: {len(gaps)}"
        return max(gaps)

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
            quiet_start = time.monotonic()
            time.sleep(2.0)
            quiet = streams.worst_gap(quiet_start, time.monotonic())

            sent = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                    text=text, sampling=generation_pb2.SamplingParams(max_tokens=1)), timeout=60).next()
            answered = time.monotonic()
            time.sleep(0.3)
            loaded = streams.worst_gap(sent, answered + 0.3)
        finally:
            streams.stop()
    # It was tokenized (not refused by its byte length), and then refused by its token count.
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens" in refused.value.details() and "max_model_len" in refused.value.details()
    ratio = loaded / quiet
    print(f"worst inter-token gap: {quiet * 1e3:.1f} ms without, {loaded * 1e3:.1f} ms while the 1 MiB prompt "
          f"was admitted ({answered - sent:.2f} s): x{ratio:.2f}")
    assert ratio < 3.0, f"the 1 MiB prompt paused the streams: worst gap {loaded * 1e3:.0f} ms vs {quiet * 1e3:.0f} ms"
