"""Backpressure through real processes and gRPC: a client that stops reading after 10 tokens has at
most the window generated past what it read (plus what its HTTP/2 stream window holds, which the
server cannot tell from read: this client keeps that to 1 KiB), its request leaves the batch while
others run on, and when it reads again it gets the rest, token for token the uninterrupted run."""
from __future__ import annotations

import time

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.client import generate, model_info
from tests.support.procs import free_port, running_services
from tools.loadtest.metrics import scrape_metrics

pytestmark = pytest.mark.timeout(180)

WINDOW = 16
LOOKAHEAD_BYTES = 1024     # the reading client's HTTP/2 stream window (no BDP growth)
PROMPT = [17, 99, 4, 250, 31, 8, 77]
MAX_TOKENS = 300


def _wait_metric(port: int, name: str, value: float, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while (m := scrape_metrics(port)).get(name) != value:
        assert time.monotonic() < deadline, f"{name} is {m.get(name)}, not {value}"
        time.sleep(0.1)
    return m


def test_a_reader_that_stops_after_10_tokens_has_at_most_the_window_generated(tiny_model_dir, tmp_path):
    port = free_port()
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=PROMPT),
        sampling=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))
    with running_services(tiny_model_dir, tmp_path / "logs", scheduler_args=(
            "--stream-window", str(WINDOW), "--metrics-port", str(port))) as svc, svc.channel() as ch:
        reference = generate(ch, token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        before = scrape_metrics(port)["llm_sampled_tokens_total"]
        slow_channel = grpc.insecure_channel(svc.scheduler_addr, options=[
            ("grpc.http2.lookahead_bytes", LOOKAHEAD_BYTES), ("grpc.http2.bdp_probe", 0),
            ("grpc.use_local_subchannel_pool", 1)])
        with slow_channel:
            call = generation_pb2_grpc.GenerationStub(slow_channel).Generate(request, timeout=120)
            read, sizes = [], []
            for msg in call:
                read += msg.token_ids
                sizes.append(msg.ByteSize())
                if len(read) >= 10:
                    break                      # stops reading: the call stays open
            _wait_metric(port, 'llm_requests_paused{group="0"}', 1.0)
            # The batch goes on without it.
            other = generate(ch, token_ids=[5, 6, 7], max_tokens=40, ignore_eos=True)
            assert other.usage.completion_tokens == 40
            generated = scrape_metrics(port)["llm_sampled_tokens_total"] - before - 40
            time.sleep(0.5)
            assert scrape_metrics(port)["llm_sampled_tokens_total"] - before - 40 == generated, "it kept generating"
            # What the client's transport holds unread: its window over the smallest message (+5 bytes framing).
            in_transport = LOOKAHEAD_BYTES // (min(sizes) + 5) + 1
            print(f"read {len(read)}, generated {generated:.0f} (window {WINDOW}, transport <= {in_transport})")
            assert generated <= len(read) + WINDOW + 2 + in_transport, generated
            assert generated < MAX_TOKENS / 3
            group = model_info(ch).worker_groups[0]
            assert group.num_running == 0

            last = None
            for msg in call:                   # reads again: the rest arrives
                read += msg.token_ids
                last = msg
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert read == reference.token_ids
        m = _wait_metric(port, 'llm_requests_paused{group="0"}', 0.0)
        assert m['llm_kv_blocks_used{group="0"}'] == 0
