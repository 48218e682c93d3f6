"""Starts the services as separate processes on loopback ports: a worker, a scheduler over
workers, or both together. The tests, the soak and the benchmarks launch them through here.

Each process runs `python -m <module>` from the repository root with its output appended to a
log file, and is ready once grpc.health.v1 says SERVING; a process that exits while it is awaited
fails the wait with the tail of its log.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

REPO = pathlib.Path(__file__).resolve().parents[1]
LOG_TAIL_CHARS = 4000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(addr: str, proc: subprocess.Popen, log: pathlib.Path, timeout: float = 240.0,
                 service: str = "") -> None:
    """Polls grpc.health.v1 until SERVING; fails early (with the log) if the process exits."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process for {addr} exited with {proc.returncode}:\n"
                                   f"{log.read_text()[-LOG_TAIL_CHARS:]}")
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.1)
    raise TimeoutError(f"{addr} not SERVING after {timeout}s:\n{log.read_text()[-LOG_TAIL_CHARS:]}")


@dataclass
class Proc:
    """One `python -m` process; start() may be called again after it stopped (same port, same log)."""
    name: str
    addr: str
    args: list[str]
    log: pathlib.Path
    popen: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)     # on top of this process's environment

    def start(self) -> "Proc":
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   **self.env)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", *self.args], cwd=REPO, env=env,
                                          stdout=log, stderr=subprocess.STDOUT)
        logger.debug("started %s (pid %d)", self.name, self.popen.pid)
        return self

    def wait_serving(self, timeout: float = 240.0) -> "Proc":
        wait_serving(self.addr, self.popen, self.log, timeout)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return self.popen.returncode if self.popen else None
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


@dataclass
class Services:
    """A scheduler and its workers, each its own process."""
    scheduler: Proc
    workers: list[Proc] = field(default_factory=list)

    @property
    def scheduler_addr(self) -> str:
        return self.scheduler.addr

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.scheduler_addr)

    def stop(self) -> None:
        self.scheduler.stop()
        for w in self.workers:
            w.stop()


def worker_proc(model_dir: pathlib.Path, log_dir: pathlib.Path, *extra: str, port: int | None = None,
                module: str = "worker_svc", env: dict[str, str] | None = None) -> Proc:
    """A worker on the CPU unless `extra` names another --device (the last flag given wins)."""
    port = port or free_port()
    args = [module, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *extra]
    return Proc(f"worker-{port}", f"127.0.0.1:{port}", args, log_dir / f"worker-{port}.log", env=env or {})


def scheduler_proc(model_dir: pathlib.Path, log_dir: pathlib.Path, worker_addrs: list[str], *extra: str) -> Proc:
    port = free_port()
    args = ["scheduler_svc", "--model", str(model_dir), "--workers", ",".join(worker_addrs),
            "--host", "127.0.0.1", "--port", str(port), *extra]
    return Proc(f"scheduler-{port}", f"127.0.0.1:{port}", args, log_dir / f"scheduler-{port}.log")


def tensor_parallel_args(group_size: int, rank: int, init_addr: str) -> tuple[str, ...]:
    """The worker flags that make a process one rank of a tensor-parallel group."""
    return ("--tensor-parallel-size", str(group_size), "--rank", str(rank), "--dist-init-addr", init_addr)


@contextlib.contextmanager
def running_services(model_dir: pathlib.Path, log_dir: pathlib.Path, *, worker_args: tuple[str, ...] = (),
                     scheduler_args: tuple[str, ...] = (), num_workers: int = 1, tensor_parallel_size: int = 1,
                     worker_env: dict[str, str] | None = None):
    """Starts num_workers workers and a scheduler over them; stops all on exit. With
    tensor_parallel_size N, each N consecutive workers are the ranks of one group (so
    num_workers / N groups serve in data parallel). `worker_env` adds to the workers' environment."""
    if num_workers % tensor_parallel_size:
        raise ValueError(f"{num_workers} workers do not split into groups of {tensor_parallel_size}")
    log_dir.mkdir(parents=True, exist_ok=True)
    rank_args = [()] * num_workers
    if tensor_parallel_size > 1:
        scheduler_args = ("--tensor-parallel-size", str(tensor_parallel_size), *scheduler_args)
        init_addrs = [f"127.0.0.1:{free_port()}" for _ in range(num_workers // tensor_parallel_size)]
        rank_args = [tensor_parallel_args(tensor_parallel_size, i % tensor_parallel_size,
                                          init_addrs[i // tensor_parallel_size]) for i in range(num_workers)]
    workers = [worker_proc(model_dir, log_dir, *worker_args, *rank_args[i], env=worker_env).start()
               for i in range(num_workers)]
    services = Services(scheduler_proc(model_dir, log_dir, [w.addr for w in workers], *scheduler_args), workers)
    try:
        for w in workers:
            w.wait_serving()
        services.scheduler.start().wait_serving()
        yield services
    finally:
        services.stop()
