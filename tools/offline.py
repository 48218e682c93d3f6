"""The same engine in one process, without gRPC: the engine core drives a ModelRunner directly.

For offline batch jobs and for measuring what the process split costs. No tokenizer, no
streams: it returns each prompt's output token ids.

    from tools.offline import LLM
    from common.sampling import SamplingParams
    llm = LLM("models/tiny-qwen3", device="cpu")
    outputs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8))
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import time

from common.constraint import Constraint, GrammarError
from common.gc_freeze import freeze_startup_heap
from common.model_dir import read_model_facts
from common.pb.llm.worker.v1 import worker_pb2
from scheduler_svc.engine.config import MOST_STEPS_IN_FLIGHT
from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.engine.api import AddCode, CoreRequest, make_seq_id
from common.sampling import SamplingParams
from scheduler_svc.engine.worker_client import WorkerError, WorkerGroupClient
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import ModelRunner
from worker_svc.step_message import build_step_response, build_worker_info, parse_step_request
from worker_svc.structured_output import FeatureUnavailable

_WORKER_FIELDS = {f.name for f in dataclasses.fields(WorkerConfig)} - {"model"}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class LocalWorkerClient:
    """A ModelRunner in this process. Steps are launched on one thread of their own, in the order
    sent, and their tokens awaited on others, so step N+1 is prepared and launched while the
    device still runs step N (as the gRPC worker does) and the event loop keeps going meanwhile."""

    def __init__(self, runner: ModelRunner) -> None:
        self.address = "local"
        self._runner = runner
        self._launcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
        # One waiter per step the engine keeps in flight (EngineConfig.fourth_step_max_seqs: up to 4).
        self._waiters = concurrent.futures.ThreadPoolExecutor(max_workers=MOST_STEPS_IN_FLIGHT,
                                                              thread_name_prefix="step-wait")

    async def describe(self, timeout: float) -> worker_pb2.WorkerInfo:
        return build_worker_info(self._runner.describe())

    async def step(self, request: worker_pb2.StepRequest, timeout: float) -> worker_pb2.StepResponse:
        loop = asyncio.get_running_loop()
        try:
            pending = await loop.run_in_executor(self._launcher, self._launch, request)
            return build_step_response(await loop.run_in_executor(self._waiters, pending.result))
        except ValueError as e:
            raise WorkerError(f"local worker refused the step: {e}") from e

    def _launch(self, request: worker_pb2.StepRequest):
        return self._runner.launch(parse_step_request(request))

    async def reset(self, lease_epoch: int, timeout: float) -> None:
        await asyncio.get_running_loop().run_in_executor(self._launcher, self._runner.reset)

    async def claim(self, owner: str, epoch: int, lease_s: float, timeout: float) -> str:
        """The runner lives in this engine's process: nobody else can drive it, so no lease."""
        return self._runner.instance_id

    async def prepare_grammar(self, constraint: Constraint, lease_epoch: int, timeout: float) -> None:
        """Compiles it in the runner's grammar pool, on a thread of its own (never the step's)."""
        try:
            await asyncio.to_thread(self._runner.prepare_grammar, constraint)
        except FeatureUnavailable as e:
            raise WorkerError(f"local worker: {e}", "UNIMPLEMENTED", str(e)) from e
        except GrammarError as e:
            raise WorkerError(f"local worker: {e}", "INVALID_ARGUMENT", f"is invalid: {e.problem}") from e

    async def close(self) -> None:
        self._launcher.shutdown(wait=True)
        self._waiters.shutdown(wait=True)


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
        self._eos_token_ids = read_model_facts(model).eos_token_ids
        self._engine_config = EngineConfig(**engine)
        self._counter = itertools.count(1)
        # When each step's tokens reached generate (time.perf_counter), for the last call: the
        # intervals are its steps' times, free of the call's own start and prefill.
        self.step_times: list[float] = []
        # As the service's processes do once ready: the model's and the kernels' objects out of the
        # collector's way, so no full collection walks them mid-generate (a pause of every request
        # in the batch; v42: one in-process decode run lost ~0.18 s in one step).
        freeze_startup_heap()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Runs every prompt (token ids) to completion, all submitted at once; returns the
        output token ids of each, in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        return asyncio.run(self._generate(prompts, params))

    async def _generate(self, prompts, params) -> list[list[int]]:
        core = EngineCore([WorkerGroupClient([LocalWorkerClient(self.runner)])], eos_token_ids=self._eos_token_ids,
                          config=self._engine_config)
        events = core.attach(0)
        await core.start()
        try:
            if not await core.wait_ready(timeout_s=60):
                raise RuntimeError(f"the local worker did not come up: {core.status.reason}")
            seq_ids = [make_seq_id(0, next(self._counter)) for _ in prompts]
            requests = [CoreRequest(seq_id, f"offline-{seq_id}", list(p), sp)
                        for seq_id, p, sp in zip(seq_ids, prompts, params)]
            for request, result in zip(requests, core.add_requests(requests)):
                if result.code != AddCode.OK:
                    raise ValueError(f"request {request.request_id} refused: {result.message}")
            outputs: dict[int, list[int]] = {seq_id: [] for seq_id in seq_ids}
            pending = set(seq_ids)
            self.step_times = []
            while pending:
                event = await events.get()
                if event.outputs is None:
                    continue
                if event.outputs.token_ids:
                    self.step_times.append(time.perf_counter())
                for seq_id, token in zip(event.outputs.seq_ids, event.outputs.token_ids):
                    outputs[seq_id].append(token)
                pending.difference_update(f.seq_id for f in event.outputs.finished)
            return [outputs[seq_id] for seq_id in seq_ids]
        finally:
            await core.shutdown(grace_s=0)
