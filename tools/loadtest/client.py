"""Sends prompts through the public Generate (or Chat) stream over grpc.aio and times every message.

With the chat API each prompt is one user message (token-id prompts are turned into text with the
server's Detokenize first), rendered by the model's chat template, with the load test's tools."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc
import numpy as np
from tqdm import tqdm

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1.generation_pb2_grpc import GenerationStub
from tools.loadtest.arrivals import arrival_offsets
from tools.loadtest.datasets import Prompt
from tools.loadtest.metrics import RequestRecord, RunResult


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _sampling(prompt: Prompt) -> pb.SamplingParams:
    sampling = pb.SamplingParams(ignore_eos=prompt.ignore_eos)
    if prompt.max_tokens is not None:
        sampling.max_tokens = prompt.max_tokens
    if prompt.json_schema is not None:
        sampling.json_schema = prompt.json_schema
    if prompt.temperature is not None:
        sampling.temperature = prompt.temperature
    return sampling


def build_request(prompt: Prompt, request_id: str) -> pb.GenerateRequest:
    sampling = _sampling(prompt)
    if prompt.token_ids is not None:
        return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt.token_ids), sampling=sampling)
    return pb.GenerateRequest(request_id=request_id, text=prompt.text, sampling=sampling)


def build_chat_request(prompt: Prompt, request_id: str, tools: list[pb.Tool], tool_choice: str) -> pb.ChatRequest:
    if prompt.text is None:
        raise ValueError("a chat request needs a text prompt (LoadClient.as_text turns token ids into text)")
    return pb.ChatRequest(request_id=request_id, messages=[pb.ChatMessage(role="user", content=prompt.text)],
                          tools=tools, tool_choice=tool_choice, sampling=_sampling(prompt))


class LoadClient:
    """Sends requests on one channel; every call carries the same auth metadata and deadline.
    `api` is "generate" or "chat" (then with `tools` and `tool_choice`)."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float | None, token: str | None,
                 api: str = "generate", tools: list[pb.Tool] = (), tool_choice: str = "auto"):
        if api not in ("generate", "chat"):
            raise ValueError(f"api must be generate or chat, got {api!r}")
        self._stub = GenerationStub(channel)
        self._timeout_s = timeout_s
        self._metadata = auth_metadata(token)
        self.api, self._tools, self._tool_choice = api, list(tools), tool_choice

    async def as_text(self, prompts: list[Prompt]) -> list[Prompt]:
        """Token-id prompts turned into their text by the server's Detokenize (for the chat API)."""
        async def one(prompt: Prompt) -> Prompt:
            if prompt.text is not None:
                return prompt
            reply = await self._stub.Detokenize(pb.DetokenizeRequest(token_ids=prompt.token_ids, skip_special_tokens=True),
                                                metadata=self._metadata, timeout=self._timeout_s or 30.0)
            return dataclasses.replace(prompt, token_ids=None, text=reply.text)
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def model_info(self) -> pb.ModelInfo:
        # A deadline even without --timeout, so a wrong --target fails fast instead of hanging.
        return await self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), metadata=self._metadata, timeout=self._timeout_s or 30.0
        )

    async def send(self, prompt: Prompt, request_id: str, run_start: float) -> RequestRecord:
        """One request, start to end; failures come back as records with their status code, never raise."""
        sent = time.perf_counter()
        record = RequestRecord(request_id, start_s=sent - run_start, requested_tokens=prompt.max_tokens)
        finish_reason = pb.FINISH_REASON_UNSPECIFIED
        try:
            if self.api == "chat":
                call = self._stub.Chat(build_chat_request(prompt, request_id, self._tools, self._tool_choice),
                                       metadata=self._metadata, timeout=self._timeout_s)
            else:
                call = self._stub.Generate(build_request(prompt, request_id), metadata=self._metadata,
                                           timeout=self._timeout_s)
            async for message in call:
                record.observe_message(time.perf_counter() - sent, len(message.token_ids))
                if message.HasField("usage"):
                    record.prompt_tokens = message.usage.prompt_tokens
                    record.cached_prompt_tokens = message.usage.cached_prompt_tokens
                if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    finish_reason = message.finish_reason
        except grpc.aio.AioRpcError as exc:
            record.status, record.error = exc.code().name, exc.details() or ""
        record.e2e_s = time.perf_counter() - sent
        if record.ok and finish_reason == pb.FINISH_REASON_ABORT:
            record.status, record.error = grpc.StatusCode.ABORTED.name, "the server aborted the request"
        elif record.ok and finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            record.status, record.error = grpc.StatusCode.UNKNOWN.name, "stream ended without a finish reason"
        return record

    async def send_all_at_once(self, prompts: list[Prompt], id_prefix: str) -> list[RequestRecord]:
        start = time.perf_counter()
        return await asyncio.gather(*(self.send(p, f"{id_prefix}-{i}", start) for i, p in enumerate(prompts)))

    async def run(
        self,
        prompts: list[Prompt],
        *,
        id_prefix: str,
        request_rate: float,
        burstiness: float,
        max_concurrency: int | None,
        rng: np.random.Generator,
        show_progress: bool,
    ) -> RunResult:
        """Sends prompts at their arrival times; with max_concurrency, arrivals beyond the limit
        wait for a free slot (their latency is timed from when they are actually sent)."""
        offsets = arrival_offsets(len(prompts), request_rate, burstiness, rng)
        limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        failed = 0
        with tqdm(total=len(prompts), desc=f"rate {request_rate:g}", unit="req", disable=not show_progress) as bar:
            run_start = time.perf_counter()

            async def paced(index: int, prompt: Prompt) -> RequestRecord:
                nonlocal failed
                await asyncio.sleep(max(0.0, run_start + offsets[index] - time.perf_counter()))
                async with limiter:
                    record = await self.send(prompt, f"{id_prefix}-{index}", run_start)
                failed += not record.ok
                bar.set_postfix(failed=failed, refresh=False)
                bar.update(1)
                return record

            records = await asyncio.gather(*(paced(i, p) for i, p in enumerate(prompts)))
            duration_s = time.perf_counter() - run_start
        return RunResult(request_rate=request_rate, duration_s=duration_s, records=list(records))
