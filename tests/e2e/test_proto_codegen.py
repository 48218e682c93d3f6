"""protos/ as a product for other languages: Node.js typings generated from it, and a Node client
built from it alone that talks to the real scheduler and gets the same greedy tokens as Python.

Needs node and npm, and the two npm packages below (installed once into a cache outside the
checkout, about 5 s and 14 MB; QWEN3_SERVE_NODE_CACHE moves it). Skips, saying why, when node or
npm is missing or the packages cannot be installed (no registry).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest

from common.client import Client
from tests.support.procs import REPO

pytestmark = pytest.mark.timeout(180)

NODE_PACKAGES = ("@grpc/grpc-js@1.14.7", "@grpc/proto-loader@0.8.1")
PROTOS = REPO / "protos"


@pytest.fixture(scope="module")
def node_modules() -> pathlib.Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    default = pathlib.Path.home() / ".cache" / "qwen3-serve" / "node"
    cache = pathlib.Path(os.environ.get("QWEN3_SERVE_NODE_CACHE", default)) / "-".join(
        p.replace("/", "_").replace("@", "") for p in NODE_PACKAGES)
    modules = cache / "node_modules"
    if not (modules / "@grpc" / "proto-loader" / "package.json").exists():
        staging = cache.with_name(cache.name + f".tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        result = subprocess.run(["npm", "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(staging),
                                 *NODE_PACKAGES], capture_output=True, text=True, timeout=150)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.skip(f"npm could not install {' '.join(NODE_PACKAGES)}: {result.stderr.strip()[-300:]}")
        shutil.rmtree(cache, ignore_errors=True)
        staging.rename(cache)   # whole or not at all, so a killed install is never taken as done
    return modules


def test_node_typings_generate_from_protos(node_modules, tmp_path):
    subprocess.run([str(node_modules / ".bin" / "proto-loader-gen-types"), "--keepCase", "--longs=String",
                    "--enums=String", "--defaults", "--oneofs", "--grpcLib=@grpc/grpc-js", f"--outDir={tmp_path}",
                    "llm/v1/generation.proto", "llm/worker/v1/worker.proto", "-I", str(PROTOS)],
                   check=True, capture_output=True, timeout=60)
    generation = (tmp_path / "llm" / "v1" / "Generation.ts").read_text()
    for method in ("Generate", "Abort", "GetModelInfo"):
        assert f"  {method}(argument: _llm_v1_" in generation, method
    assert "grpc.ClientReadableStream<_llm_v1_GenerateResponse__Output>" in generation   # server streaming
    sampling = (tmp_path / "llm" / "v1" / "SamplingParams.ts").read_text()
    assert "'top_p'?: (number | string);" in sampling and "'seed'?: (number | string | Long);" in sampling
    assert (tmp_path / "llm" / "worker" / "v1" / "Worker.ts").exists()


def test_a_node_client_from_protos_gets_the_same_tokens_as_python(node_modules, services):
    env = dict(os.environ, NODE_PATH=str(node_modules))
    result = subprocess.run(["node", str(REPO / "tests" / "support" / "node" / "generation_client.js"), str(PROTOS),
                             services.scheduler_addr, "Once upon a time", "8"],
                            env=env, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    node = json.loads(result.stdout)
    with Client(services.scheduler_addr) as client:
        python = client.generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)
        info = client.model_info()
    assert node["model"] == info.model and node["vocab_size"] == info.vocab_size
    assert node["token_ids"] == python.token_ids and node["text"] == python.text
    assert node["finish_reason"] == "FINISH_REASON_LENGTH" and node["usage"]["completion_tokens"] == 8
