"""The same engine in one process, without gRPC: the scheduler loop drives a ModelRunner directly.

For offline batch jobs and for measuring what the process split costs:

    llm = LLM("models/tiny-qwen3", device="cpu")
    outputs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8))
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools

from common.model_dir import read_model_facts
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.worker_client import LocalWorkerClient, WorkerGroupClient
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import ModelRunner

_WORKER_FIELDS = {f.name for f in dataclasses.fields(WorkerConfig)} - {"model"}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class LLM:
    def __init__(self, model: str, **options) -> None:
        unknown = set(options) - _WORKER_FIELDS - _ENGINE_FIELDS
        if unknown:
            raise TypeError(f"unknown options: {sorted(unknown)}")
        worker = {k: v for k, v in options.items() if k in _WORKER_FIELDS}
        engine = {k: v for k, v in options.items() if k in _ENGINE_FIELDS}
        # Shared knobs mean the same on both sides (the worker sizes warm-up and graphs by them).
        for shared in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if shared in options:
                worker[shared] = engine[shared] = options[shared]
        self.runner = ModelRunner(WorkerConfig(model=model, **worker))
        facts = read_model_facts(model)
        self._engine_args = dict(
            tokenizer=load_tokenizer(model), eos_token_ids=facts.eos_token_ids, vocab_size=facts.vocab_size,
            config=EngineConfig(**engine),
        )
        self._request_ids = itertools.count()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Runs every prompt (token ids) to completion, all submitted at once; returns the
        output token ids of each, in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        return asyncio.run(self._generate(prompts, params))

    async def _generate(self, prompts, params) -> list[list[int]]:
        engine = Engine([WorkerGroupClient([LocalWorkerClient(self.runner)])], **self._engine_args)
        await engine.start()
        try:
            streams = [engine.add_request(f"offline-{next(self._request_ids)}", list(p), sp)
                       for p, sp in zip(prompts, params)]
            return list(await asyncio.gather(*(self._collect(s) for s in streams)))
        finally:
            await engine.shutdown(grace_s=0)

    @staticmethod
    async def _collect(stream) -> list[int]:
        tokens: list[int] = []
        async for out in stream:
            tokens += out.token_ids
        return tokens
