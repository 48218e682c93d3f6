"""python -m worker_svc --model DIR --port PORT [...]: one worker process (one GPU, or the CPU)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from common.logging_setup import setup_logging
from worker_svc.config import DEFAULT_PORT, add_worker_arguments, worker_config_from_args

logger = logging.getLogger("worker_svc")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_svc", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--log-level", default="INFO")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = worker_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())

    # Imported after argument parsing so --help is instant (torch takes seconds to import).
    from worker_svc.model_runner import ModelRunner
    from worker_svc.server import WorkerServer

    server = WorkerServer(args.host, args.port)
    server.start()
    try:
        runner = ModelRunner(config)
    except Exception:
        logger.exception("could not load the model")
        server.stop(grace=0)
        return 1
    server.serve(runner)
    while not stop.wait(timeout=1.0):   # a timed wait lets the signal handler run promptly
        pass
    logger.info("shutting down")
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
