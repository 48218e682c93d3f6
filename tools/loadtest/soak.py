"""Soak test: runs a worker and a scheduler, drives them above capacity with random client
cancels, slow readers and one worker SIGKILL + restart, then checks that nothing was lost. The
first --burst requests arrive at once (more than the batch and the waiting queue hold, so some are
refused however fast the machine), the rest at --rate. Then hostile clients (an ambiguous regex,
a wide schema, a huge chat, a huge Detokenize, slow clients, early cancels, priority floods, ...)
run beside well-behaved probe streams: the probes' worst inter-token gap with them, against the
same without them in the same run (the median over rounds), must stay within --max-gap-ratio, that
worst gap in units of its window's median within --max-stall-ratio, and the median gap within
--max-slowdown-ratio (tools/loadtest/hostile.py says what each catches).

    python -m tools.loadtest.soak [--model DIR] [--duration 60] [--rate 12] [--out FILE]

Every request is greedy and ignores EOS, drawn from a pool of specs whose undisturbed outputs are
generated first (the references). Afterwards:
  - every admitted request either completed with exactly its reference's tokens, or was cancelled
    by its client after a prefix of them; every other request was refused with a clear status
    (RESOURCE_EXHAUSTED past the waiting bound); nothing ended UNKNOWN, INTERNAL or UNAVAILABLE;
  - every KV block is free, and nothing runs, waits or stays paused;
  - the metrics (--metrics-port) agree with the client: finished by length = completed, aborted =
    cancelled, rejected = refused, and the tokens counted as sampled = the tokens of finished ones.
It prints the figures (requests, completions, cancels, refusals, slow readers, restarts, blocks
leaked) and exits 1 when a check fails. Without --model it writes the tiny seeded checkpoint.

Cancelling and slow clients read through a channel whose HTTP/2 stream window is small
(--lookahead-bytes): the server counts what a client's transport holds as read, so with a small
window a slow reader's request is paused by backpressure (--stream-window) rather than buffered,
and a cancel reaches the server before the request can have finished.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

import grpc
import numpy as np

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1.generation_pb2_grpc import GenerationStub
from tools.launch import free_port, scheduler_proc, worker_proc
from tools.loadtest.arrivals import arrival_offsets
from tools.loadtest.hostile import HostileRounds, HostileSettings
from tools.loadtest.hostile import measure as measure_hostile
from tools.loadtest.metrics import scrape_metrics

# Outcomes of one request, as the client saw it.
COMPLETED, CANCELLED, REFUSED, DEADLINE, ERROR = "completed", "cancelled", "refused", "deadline", "error"


@dataclass(frozen=True)
class Spec:
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    index: int
    spec: int
    kind: str                      # normal, cancel, slow
    status: str = ""
    tokens: list[int] = field(default_factory=list)
    detail: str = ""


# -- the service's processes ---------------------------------------------------------------------

class Processes:
    """One worker and one scheduler (tools/launch.py) writing logs into a directory, and the
    scheduler's Prometheus metrics."""

    def __init__(self, model: pathlib.Path, logs: pathlib.Path, worker_args: list[str], scheduler_args: list[str]):
        self.logs = logs
        self.metrics_port = free_port()
        self.worker = worker_proc(model, logs, *worker_args)
        self.scheduler = scheduler_proc(model, logs, [self.worker.addr], "--metrics-port", str(self.metrics_port),
                                        *scheduler_args)
        self.restarts = 0

    @property
    def address(self) -> str:
        return self.scheduler.addr

    def start(self) -> None:
        self.worker.start()
        self.scheduler.start()

    def kill_worker(self) -> None:
        self.worker.kill()

    def restart_worker(self) -> None:
        self.worker.start()
        self.restarts += 1

    def stop(self) -> None:
        self.scheduler.stop(timeout=20)
        self.worker.stop(timeout=20)

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.metrics_port)


async def _wait_ready(stub: GenerationStub, procs: Processes, timeout_s: float) -> pb.ModelInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in (procs.worker.popen, procs.scheduler.popen):
            if proc.poll() is not None:
                raise RuntimeError(f"a service process exited with {proc.returncode}; see {procs.logs}")
        try:
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
            if info.worker_groups and all(g.healthy for g in info.worker_groups):
                return info
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the service was not ready within {timeout_s}s; see {procs.logs}")
        await asyncio.sleep(0.2)


# -- the load --------------------------------------------------------------------------------------

@dataclass
class LoadSettings:
    """The load phase: requests above capacity, cancels, slow readers and a worker killed."""
    duration_s: float = 60.0
    rate: float = 12.0                 # requests/s, above what the tiny model serves on 2 cores
    burst: int = 48                    # of them sent at once at the start: more than --max-num-seqs +
                                       # --max-waiting, so the load is above capacity on any machine
    seed: int = 0
    num_specs: int = 24
    cancel_fraction: float = 0.2
    slow_fraction: float = 0.15
    slow_read_delay_s: float = 0.03    # between two messages of a slow reader
    # and once, after its first message, until a pause was seen (at most this long): backpressure
    # however slow the machine
    slow_read_stall_s: float = 30.0
    kill_at: float = 0.4               # of the duration
    restart_after_s: float = 1.0
    stream_window: int = 16
    lookahead_bytes: int = 1024
    max_waiting: int = 24
    max_num_seqs: int = 16
    num_kv_blocks: int = 160
    # One frontend process: the public API's requests handled apart from the engine core, as on any
    # host of more than 2 cores (0 puts the hostile requests' admission in the core's process).
    frontends: int = 1
    device: str = "cpu"
    request_timeout_s: float = 300.0


@dataclass
class SoakSettings(HostileRounds, LoadSettings):
    """The load phase's settings, then the hostile phase's: after the load, probe streams alone
    (quiet_s), then beside hostile clients (hostile_s), in `rounds` turns; the medians of the
    rounds' ratios must stay within the max_*_ratio bounds (tools/loadtest/hostile.py; 0: reported,
    not judged). hostile_s 0: no such phase."""


def _specs(settings: SoakSettings, vocab_size: int) -> list[Spec]:
    rng = random.Random(settings.seed)
    # A cancel lands after at most 10 tokens; the window, the transport and two steps in flight
    # add < 50 more, so a request of 80+ tokens cannot have finished before its cancel arrives.
    return [Spec([rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 80))], rng.randint(80, 160))
            for _ in range(settings.num_specs)]


async def _one(stub: GenerationStub, out: Outcome, spec: Spec, cancel_after: int, delay_s: float,
               timeout_s: float, stall_s: float = 0.0, stall_until: asyncio.Event | None = None) -> None:
    """One request; a reader with `delay_s` waits that long between messages, and after its first
    one until `stall_until` is set (at most stall_s)."""
    call = stub.Generate(pb.GenerateRequest(
        request_id=f"soak-{out.index}", token_ids=pb.TokenIds(ids=spec.prompt),
        sampling=pb.SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, temperature=0.0)), timeout=timeout_s)
    finish = pb.FINISH_REASON_UNSPECIFIED
    try:
        async for message in call:
            out.tokens += message.token_ids
            finish = message.finish_reason or finish
            if cancel_after and len(out.tokens) >= cancel_after and not finish:
                call.cancel()
                out.status = CANCELLED
                return
            if stall_s:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for((stall_until or asyncio.Event()).wait(), stall_s)
                stall_s = 0.0
            elif delay_s:
                await asyncio.sleep(delay_s)
    except grpc.aio.AioRpcError as e:
        code = e.code()
        out.status = {grpc.StatusCode.RESOURCE_EXHAUSTED: REFUSED,
                      grpc.StatusCode.DEADLINE_EXCEEDED: DEADLINE}.get(code, ERROR)
        out.detail = f"{code.name}: {e.details()}"
        return
    if finish == pb.FINISH_REASON_LENGTH:
        out.status = COMPLETED
    else:
        out.status, out.detail = ERROR, f"stream ended with finish reason {pb.FinishReason.Name(finish)}"


async def _monitor(procs: Processes, peaks: Counter, stop: asyncio.Event, paused_seen: asyncio.Event) -> None:
    """Records the peaks of running, waiting and paused requests (the load was above capacity,
    slow readers were paused); sets paused_seen at the first paused request."""
    while not stop.is_set():
        try:
            m = await asyncio.to_thread(procs.metrics)
        except OSError:
            m = {}
        for what in ("running", "waiting", "paused"):
            peaks[what] = max(peaks[what], int(m.get(f'llm_requests_{what}{{group="0"}}', 0)))
        if peaks["paused"]:
            paused_seen.set()
        await asyncio.sleep(0.25)


async def _drive(settings: SoakSettings, procs: Processes, specs: list[Spec], figures: dict) -> list[Outcome]:
    """Sends the disturbed load, kills the worker and restarts it midway, returns every outcome."""
    rng = random.Random(settings.seed + 1)
    count = max(1, round(settings.rate * settings.duration_s))
    offsets = arrival_offsets(count, settings.rate, 1.0, np.random.default_rng(settings.seed))
    offsets[:settings.burst] = 0.0
    small_window = [("grpc.http2.lookahead_bytes", settings.lookahead_bytes), ("grpc.http2.bdp_probe", 0),
                    ("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(procs.address) as fast, \
            grpc.aio.insecure_channel(procs.address, options=small_window) as slow:
        stubs = {"normal": GenerationStub(fast), "cancel": GenerationStub(slow), "slow": GenerationStub(slow)}
        start = time.monotonic()

        async def disturb() -> None:
            await asyncio.sleep(settings.kill_at * settings.duration_s)
            procs.kill_worker()
            figures["worker_killed_at_s"] = round(time.monotonic() - start, 2)
            await asyncio.sleep(settings.restart_after_s)
            procs.restart_worker()

        async def paced(i: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.monotonic()))
            draw = rng.random()
            kind = ("cancel" if draw < settings.cancel_fraction
                    else "slow" if draw < settings.cancel_fraction + settings.slow_fraction else "normal")
            spec_index = rng.randrange(len(specs))
            out = Outcome(i, spec_index, kind)
            await _one(stubs[kind], out, specs[spec_index], rng.randint(1, 10) if kind == "cancel" else 0,
                       settings.slow_read_delay_s if kind == "slow" else 0.0, settings.request_timeout_s,
                       settings.slow_read_stall_s if kind == "slow" else 0.0, paused_seen)
            return out

        peaks: Counter = Counter()
        stop, paused_seen = asyncio.Event(), asyncio.Event()
        background = [asyncio.create_task(disturb()), asyncio.create_task(_monitor(procs, peaks, stop, paused_seen))]
        outcomes = await asyncio.gather(*(paced(i) for i in range(count)))
        stop.set()
        await asyncio.gather(*background)
        figures["load_s"] = round(time.monotonic() - start, 2)
        figures.update({f"peak_{what}": peaks[what] for what in ("running", "waiting", "paused")})
    return list(outcomes)


# -- the checks ------------------------------------------------------------------------------------

async def _settle(stub: GenerationStub, procs: Processes, timeout_s: float = 120.0) -> pb.WorkerGroupInfo:
    """Waits until nothing runs, waits or is paused, and returns the group's state."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        g = info.worker_groups[0]
        m = procs.metrics()
        idle = (g.healthy and not g.num_running and not m.get('llm_requests_waiting{group="0"}')
                and not m.get('llm_requests_paused{group="0"}') and g.num_free_kv_blocks == g.num_kv_blocks)
        if idle or time.monotonic() > deadline:
            return g
        await asyncio.sleep(0.2)


def check(outcomes: list[Outcome], references: list[list[int]], group: pb.WorkerGroupInfo,
          metrics: dict[str, float], num_reference_requests: int) -> tuple[dict, list[str]]:
    """The figures of a run and what is wrong with it (empty when nothing is)."""
    failures: list[str] = []
    status = Counter(o.status for o in outcomes)
    for o in outcomes:
        ref = references[o.spec]
        if o.status == COMPLETED and o.tokens != ref:
            failures.append(f"request {o.index} ({o.kind}) completed with other tokens than its reference")
        elif o.status == CANCELLED and o.tokens != ref[:len(o.tokens)]:
            failures.append(f"request {o.index} was cancelled after tokens that are not its reference's prefix")
        elif o.status == ERROR:
            failures.append(f"request {o.index} ({o.kind}) ended without a clear status: {o.detail}")
        elif o.status == REFUSED and o.tokens:
            failures.append(f"request {o.index} was refused after {len(o.tokens)} tokens: {o.detail}")
    leaked = group.num_kv_blocks - group.num_free_kv_blocks
    if leaked or group.num_running:
        failures.append(f"{leaked} KV blocks and {group.num_running} running requests left after the soak")

    def metric(name: str) -> float:
        return metrics.get(name, 0.0)

    agreements = {
        "finished by length": (metric('llm_requests_finished_total{reason="length"}'),
                               status[COMPLETED] + num_reference_requests),
        "finished by abort": (metric('llm_requests_finished_total{reason="abort"}'), status[CANCELLED]),
        "rejected (RESOURCE_EXHAUSTED)": (metric('llm_requests_rejected_total{code="RESOURCE_EXHAUSTED"}'),
                                          status[REFUSED]),
        "sampled tokens = generated tokens": (metric("llm_sampled_tokens_total"),
                                              metric("llm_generated_tokens_total")),
    }
    for what, (server, client) in agreements.items():
        if server != client:
            failures.append(f"metrics disagree: {what}: server {server:g}, client {client:g}")
    completed_tokens = sum(len(o.tokens) for o in outcomes if o.status == COMPLETED)
    cancelled_tokens = sum(len(o.tokens) for o in outcomes if o.status == CANCELLED)
    reference_tokens = sum(len(r) for r in references)
    # A cancelled request was generated for at least as far as its client read.
    if metric("llm_generated_tokens_total") < completed_tokens + cancelled_tokens + reference_tokens:
        failures.append("the server counts fewer generated tokens than the clients received")
    if metric('llm_worker_failures_total{group="0"}') < 1:
        failures.append("the scheduler never noticed the killed worker")
    figures = {
        "requests": len(outcomes), "completed": status[COMPLETED], "cancelled": status[CANCELLED],
        "refused": status[REFUSED], "deadline_exceeded": status[DEADLINE], "errors": status[ERROR],
        "slow_readers": sum(o.kind == "slow" for o in outcomes),
        "slow_readers_completed": sum(o.kind == "slow" and o.status == COMPLETED for o in outcomes),
        "tokens_received": completed_tokens + cancelled_tokens, "blocks_leaked": leaked,
        "worker_failures_seen": int(metric('llm_worker_failures_total{group="0"}')),
        "preemptions": group.num_preemptions,
    }
    return figures, failures


async def soak(settings: SoakSettings, model: pathlib.Path, logs: pathlib.Path) -> tuple[dict, list[str]]:
    procs = Processes(
        model, logs,
        worker_args=["--device", settings.device, "--num-kv-blocks", str(settings.num_kv_blocks)],
        scheduler_args=["--max-waiting", str(settings.max_waiting), "--max-num-seqs", str(settings.max_num_seqs),
                        "--stream-window", str(settings.stream_window), "--frontends", str(settings.frontends)])
    figures: dict = {}
    try:
        procs.start()
        async with grpc.aio.insecure_channel(procs.address) as channel:
            stub = GenerationStub(channel)
            info = await _wait_ready(stub, procs, timeout_s=180)
            specs = _specs(settings, info.vocab_size)
            references = await asyncio.gather(*(_reference(stub, s) for s in specs))
            outcomes = await _drive(settings, procs, specs, figures)
            figures["worker_restarts"] = procs.restarts
            group = await _settle(stub, procs)
            await asyncio.sleep(1.5)        # frontends report rejections once a second
            run_figures, failures = check(outcomes, references, group, procs.metrics(), len(specs))
            figures.update(run_figures)
            if settings.hostile_s > 0:
                hostile_figures, hostile_failures = await _hostile_phase(settings, procs, info)
                figures.update(hostile_figures)
                failures += hostile_failures
                group = await _settle(stub, procs)
                leaked = group.num_kv_blocks - group.num_free_kv_blocks
                if leaked or group.num_running:
                    failures.append(f"{leaked} KV blocks and {group.num_running} running requests left after the "
                                    f"hostile phase")
    finally:
        procs.stop()
    return figures, failures


async def _hostile_phase(settings: SoakSettings, procs: Processes, info: pb.ModelInfo) -> tuple[dict, list[str]]:
    """Probe streams alone, then beside the hostile clients (tools/loadtest/hostile.py)."""
    rounds = {f.name: getattr(settings, f.name) for f in fields(HostileRounds)}
    hostile = HostileSettings(**rounds, eos_token_ids=tuple(info.eos_token_ids))
    async with grpc.aio.insecure_channel(procs.address) as channel:
        return await measure_hostile(procs.address, GenerationStub(channel), hostile, info.vocab_size)


async def _reference(stub: GenerationStub, spec: Spec) -> list[int]:
    tokens = []
    async for message in stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=spec.prompt),
            sampling=pb.SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, temperature=0.0)), timeout=600):
        tokens += message.token_ids
    if len(tokens) != spec.max_tokens:
        raise RuntimeError(f"a reference run gave {len(tokens)} tokens, not {spec.max_tokens}")
    return tokens


def format_figures(figures: dict, failures: list[str]) -> str:
    lines = ["soak: " + ("PASSED" if not failures else f"FAILED ({len(failures)} problems)")]
    lines += [f"  {name:<24} {value}" for name, value in figures.items()]
    lines += [f"  ! {f}" for f in failures[:20]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[SoakSettings, argparse.Namespace]:
    defaults = SoakSettings()
    ap = argparse.ArgumentParser(prog="python -m tools.loadtest.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=pathlib.Path, help="model directory (unset: write the tiny seeded checkpoint)")
    ap.add_argument("--logs", type=pathlib.Path, help="where the services' logs go (unset: a temporary directory)")
    ap.add_argument("--out", type=pathlib.Path, help="write the figures and problems as JSON")
    for name, value in asdict(defaults).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = ap.parse_args(argv)
    settings = SoakSettings(**{name: getattr(args, name) for name in asdict(defaults)})
    return settings, args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        model = args.model
        if model is None:
            from common.tiny_model import write_tiny_qwen3
            model = write_tiny_qwen3(pathlib.Path(scratch) / "tiny-qwen3")
        logs = args.logs or pathlib.Path(scratch) / "logs"
        figures, failures = asyncio.run(soak(settings, model, logs))
        print(format_figures(figures, failures))
        if args.out:
            args.out.write_text(json.dumps({"settings": asdict(settings), "figures": figures, "failures": failures},
                                           indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
