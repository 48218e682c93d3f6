"""python -m worker_svc --model DIR --port PORT [...]: one worker process (one GPU, or the CPU).

With --tensor-parallel-size N it is rank --rank of a group of N such processes that meet at
--dist-init-addr (rank 0's address); the scheduler sends every step to all of them. Exit codes:
0 after SIGTERM/SIGINT, 1 when the model cannot load, EXIT_GROUP_BROKEN when a peer rank died or
a collective timed out (--dist-timeout).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

from common.cli import ArgumentParser, add_logging_arguments, is_loopback, warn_if_exposed
from common.logging_setup import setup_logging
from common.security import add_server_security_arguments, server_security_from_args
from worker_svc.config import DEFAULT_PORT, add_worker_arguments, worker_config_from_args
from worker_svc.lease import DEFAULT_MAX_DURATION_S

logger = logging.getLogger(__name__)

EXIT_GROUP_BROKEN = 3   # a peer rank died or a collective timed out
_PROCESS_WIDE = contextlib.ExitStack()   # contexts held for the process's life (a dropped one is undone)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m worker_svc", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port of the llm.worker.v1 API")
    parser.add_argument("--max-lease", type=float, default=DEFAULT_MAX_DURATION_S, metavar="SECONDS",
                        help="the longest lease a scheduler's claim is granted (a longer one is cut to this): once "
                             "its owner falls silent, nobody can keep the worker from other schedulers for longer")
    add_logging_arguments(parser)
    add_server_security_arguments(parser, "the scheduler")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="listen beyond loopback without --auth-token(-file) or --tls-client-ca: anyone who "
                             "reaches the port can drive the worker (only behind a network policy that keeps "
                             "everyone else out); without it such a worker refuses to start")
    add_worker_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config = worker_config_from_args(args)
        auth_token, credentials = server_security_from_args(args, logger)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if not args.max_lease > 0:
        parser.error(f"--max-lease must be positive, got {args.max_lease}")
    authenticated = bool(auth_token) or bool(args.tls_client_ca)   # a token, or mutual TLS
    if not (authenticated or args.allow_unauthenticated or is_loopback(args.host)):
        parser.error(f"--host {args.host} is reachable beyond this machine, and without --auth-token-file (or "
                     f"--tls-client-ca) anyone who reaches the port can drive this worker: give it a token, or "
                     f"--allow-unauthenticated if a network policy keeps everyone else out")
    warn_if_exposed(args.host, args.port, has_token=bool(auth_token), has_tls=credentials is not None, log=logger,
                    what="this worker (it runs any step the caller sends)")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())

    if config.sampler == "kernels" and config.device == "cpu":
        _interpret_kernels()
    # Imported after argument parsing so --help is instant (torch takes seconds to import).
    from worker_svc import parallel_state
    from worker_svc.model_runner import ModelRunner
    from worker_svc.server import WorkerServer

    server = WorkerServer(args.host, args.port, auth_token=auth_token, credentials=credentials,
                          max_lease_s=args.max_lease)
    server.start()
    threading.Thread(target=_exit_when_group_breaks, args=(server, parallel_state.group_broken()), daemon=True,
                     name="tp-exit").start()
    try:
        parallel_state.init_tensor_parallel(config)
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
    parallel_state.destroy_tensor_parallel()
    return 0


def _interpret_kernels() -> None:
    """--sampler kernels on the CPU (tests, smoke runs): the Triton kernels run under Triton's
    interpreter, patched for this process to compute as a GPU does (tools/triton_interpreter.py;
    before anything imports triton)."""
    from tools import triton_interpreter

    _PROCESS_WIDE.enter_context(triton_interpreter.faster_interpreter())   # first, as the tests' session does
    _PROCESS_WIDE.enter_context(triton_interpreter.gpu_faithful())


def _exit_when_group_breaks(server, broken: threading.Event) -> None:
    """A broken tensor-parallel group cannot heal: exit (EXIT_GROUP_BROKEN) so that every rank
    restarts and they form a new group. Hard, because a step or the start-up may be stuck in
    a collective that will never complete."""
    broken.wait()
    logger.error("exiting: every rank of the group must restart to form it again")
    server.stop(grace=1.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_GROUP_BROKEN)


if __name__ == "__main__":
    sys.exit(main())
