"""A benchmark client spread over processes: each sends its share of the prompts, all at once,
each stream on a connection of its own process, and times every message. One Python process
writing hundreds of streams is itself a bound (its event loop at one core), so the load comes from
several, and their CPU is reported beside the server's."""
from __future__ import annotations

import asyncio
import multiprocessing
import queue as queue_module
import time

import grpc

MAX_MESSAGE_BYTES = 64 << 20


def _client_main(addr: str, prompts, id_prefix: str, go, connections: int, queue) -> None:
    from tools.loadtest.client import LoadClient

    async def run():
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(addr, options=options) for _ in range(connections)]
        for ch in channels:
            await ch.channel_ready()
        clients = [LoadClient(ch, timeout_s=None, token=None) for ch in channels]
        queue.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        started = time.perf_counter()
        records = await asyncio.gather(*(clients[i % connections].send(p, f"{id_prefix}-{i}", started)
                                         for i, p in enumerate(prompts)))
        for ch in channels:
            await ch.close()
        return records

    records = asyncio.run(run())
    queue.put(([r.to_json() for r in records], time.time()))


def send_from_processes(addr: str, prompts, *, processes: int, connections_per_process: int = 4,
                        id_prefix: str = "bench", on_start=None) -> tuple[list[dict], float, list[int]]:
    """Sends every prompt (tools.loadtest.datasets.Prompt) at once from `processes` processes;
    returns the request records (RequestRecord.to_json() dicts), the wall time from the common start to
    the last reply, and the client pids. on_start(pids) is called once they run (for CPU sampling)."""
    ctx = multiprocessing.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    shares = [prompts[i::processes] for i in range(processes)]
    procs = [ctx.Process(target=_client_main, args=(addr, share, f"{id_prefix}{i}", go,
                                                   connections_per_process, queue), daemon=True)
             for i, share in enumerate(shares) if share]
    for p in procs:
        p.start()
    ready = 0
    while ready < len(procs):   # a process's start-up (imports, connections) is never part of the timed run
        try:
            ready += queue.get(timeout=1.0) == "ready"
        except queue_module.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a client process failed before it was ready") from None
    if on_start is not None:
        on_start([p.pid for p in procs])
    start_at = time.time()
    go.set()
    records, finished = [], start_at
    for _ in procs:
        share, ended = queue.get()
        records += share
        finished = max(finished, ended)
    for p in procs:
        p.join()
    return records, finished - start_at, [p.pid for p in procs]
