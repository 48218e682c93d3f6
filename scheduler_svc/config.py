"""The scheduler service's own settings (the model, the workers, its processes): one dataclass
whose fields are also its flags (common.cli.flag). The engine core's and the frontends' are in
scheduler_svc/engine/config.py and scheduler_svc/frontend/config.py."""
from __future__ import annotations

from dataclasses import dataclass

from common.cli import flag


@dataclass(frozen=True)
class ServiceConfig:
    model: str = flag(help="Hugging Face model directory (tokenizer and config are read from it)")
    workers: str = flag(help="worker addresses, comma-separated (host:port, unix:PATH, or dns:///NAME:PORT for every "
                             "address NAME resolves to); with --tensor-parallel-size N, each N consecutive addresses "
                             "form one group, rank 0 first; several groups serve in data parallel")
    tensor_parallel_size: int = flag(1, help="ranks per worker group")
    frontends: int | None = flag(None, help="frontend processes serving the public port (0: one, inside the core's "
                                            "process; unset: one per 4 cores, up to 8, none on 2 cores or fewer)")
    core_address: str | None = flag(None, help="where the engine core listens for its frontends (unset: a unix "
                                               "socket in a private temporary directory)")
    shutdown_grace: float = flag(30.0, help="seconds SIGTERM lets running requests finish")
    metrics_port: int = flag(0, help="serve Prometheus metrics over HTTP on this port (0: off)")
