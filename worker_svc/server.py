"""gRPC front of the worker: llm.worker.v1.Worker, grpc.health.v1 and server reflection.

The port opens before the model loads (health NOT_SERVING, Worker calls UNAVAILABLE), so an
orchestrator can tell "starting" from "dead"; health turns SERVING once the runner is ready.
Steps are serial by nature: one call at a time enters the runner, steps in step_id order
(worker_svc.step_order says why). A worker serves one scheduler at a time: Step and Reset carry
the epoch of that scheduler's lease (worker_svc.lease), taken and renewed with Claim.
With a token every call but health needs `authorization: Bearer <token>`; with credentials the
port speaks only TLS (mutual TLS when they name a client CA).
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.gc_freeze import freeze_startup_heap
from common.pb.llm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.reflection import enable_server_reflection
from common.security import TokenAuthInterceptor
from common.status_guard import StatusGuardInterceptor, bounded_message
from common.constraint import Constraint, GrammarError
from worker_svc.late_compiles import watch_late_compiles
from worker_svc.lease import DEFAULT_MAX_DURATION_S, LeaseHeld, StaleLease, WorkerLease
from worker_svc.model_runner import ModelRunner
from worker_svc.runner_io import InvalidStepError, StaleMirrorError
from worker_svc.step_message import build_step_response, build_worker_info, parse_step_request
from worker_svc.structured_output import FeatureUnavailable
from worker_svc.step_order import StepOrder

logger = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# A NewRequest carries a whole prompt: 128k tokens of varint ids fit well within this.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
RPC_THREADS = 8


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, max_lease_s: float = DEFAULT_MAX_DURATION_S) -> None:
        self._runner: ModelRunner | None = None
        self._order = StepOrder()
        self.lease = WorkerLease(max_duration_s=max_lease_s)
        self._streams: set[_LaunchedSteps] = set()
        self._streams_lock = threading.Lock()

    def attach(self, runner: ModelRunner) -> None:
        self._runner = runner

    def _ready_runner(self, context: grpc.ServicerContext) -> ModelRunner:
        if self._runner is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self._runner

    def Describe(self, request, context):
        return build_worker_info(self._ready_runner(context).describe())

    def Step(self, request, context):
        """Launches the step in its turn, then waits for its tokens outside the turn: the next
        step's thread launches meanwhile, so its preparation overlaps this one's device work."""
        code, message, response = self._settle(*self._launch(self._ready_runner(context), request))
        if code is None:
            return response
        context.abort(code, message)

    def Steps(self, requests, context):
        """The steps of one stream: a thread reads and launches each in its turn while this one
        waits for their tokens in order and answers each (a StepError where Step would abort)."""
        runner = self._ready_runner(context)
        steps = _LaunchedSteps(self._settle)

        def read() -> None:
            try:
                for request in requests:
                    steps.put(self._launch(runner, request))
            except grpc.RpcError:      # the stream ended under it (cancelled, the client gone)
                pass
            except Exception:          # noqa: BLE001 - the steps launched so far are still answered
                logger.exception("the step stream's reader failed")
            finally:
                steps.end()

        with self._streams_lock:
            self._streams.add(steps)
        threading.Thread(target=read, name="worker-steps", daemon=True).start()
        try:
            while (item := steps.get()) is not None:
                code, message, response = self._settle(*item)
                if code is None:
                    yield worker_pb2.StepResult(response=response)
                else:
                    yield worker_pb2.StepResult(error=worker_pb2.StepError(
                        step_id=item[0].step_id, code=code.name, message=message))
        finally:   # ended, or closed early: each step launched and not answered still releases what it holds
            steps.close()
            with self._streams_lock:
                self._streams.discard(steps)

    def end_streams(self) -> None:
        """Ends every Steps stream once the steps it launched are answered (the worker is stopping)."""
        with self._streams_lock:
            for steps in self._streams:
                steps.end()

    def _launch(self, runner: ModelRunner, request):
        """(request, code, message, pending): the step launched in its turn, or why it was not."""
        what = f"step {request.step_id}"
        try:      # early: no wait for a turn it would not get
            self.lease.check(request.lease_epoch, what)
        except StaleLease as exc:
            return request, grpc.StatusCode.FAILED_PRECONDITION, str(exc), None
        code = message = pending = None
        try:
            step = parse_step_request(request)
        except InvalidStepError as exc:
            step, code, message = None, grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        with self._order.step(request.step_id) as turn:   # taken even by a bad step: its id is used up
            try:
                # Again in the turn: another scheduler may have claimed the worker meanwhile.
                self.lease.check(request.lease_epoch, what)
            except StaleLease as exc:
                turn.skip()
                step, code, message = None, grpc.StatusCode.FAILED_PRECONDITION, str(exc)
            if step is not None:
                code, message, pending = self._guarded(request.step_id, runner.launch, step)
        return request, code, message, pending

    def _settle(self, request, code, message, pending):
        """(None, None, response) once a launched step's tokens are in, else (code, message, None)."""
        if code is None:
            code, message, output = self._guarded(request.step_id, pending.result)
            if code is None:
                self.lease.touch(request.lease_epoch)
                return None, None, build_step_response(output)
        if code != grpc.StatusCode.INTERNAL:
            logger.warning("rejected step %d: %s", request.step_id, message)
        return code, bounded_message(message), None

    def _check_lease(self, epoch: int, what: str, context: grpc.ServicerContext) -> None:
        try:
            self.lease.check(epoch, what)
        except StaleLease as exc:
            logger.warning("%s", exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    @staticmethod
    def _guarded(step_id: int, call, *args):
        """(None, None, result), or the status code and message a failure maps to."""
        try:
            return None, None, call(*args)
        except StaleMirrorError as exc:
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc), None
        except InvalidStepError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc), None
        except Exception as exc:   # mid-step, e.g. the device ran out of memory
            logger.exception("step %d failed", step_id)
            return (grpc.StatusCode.INTERNAL,
                    f"step failed: {exc!r}; the worker's batch may be inconsistent: Reset and re-send it", None)

    def Reset(self, request, context):
        runner = self._ready_runner(context)
        self._check_lease(request.lease_epoch, "reset", context)
        refused = None
        with self._order.exclusive() as turn:
            try:
                self.lease.check(request.lease_epoch, "reset")
                runner.reset()
            except StaleLease as exc:
                turn.skip()
                refused = exc
        if refused is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(refused))
        logger.info("reset: every request mirror dropped")
        return worker_pb2.ResetResponse()

    def Claim(self, request, context):
        runner = self._ready_runner(context)
        code = message = None
        try:
            granted_s = self.lease.claim(request.owner, request.epoch, request.lease_ms / 1000)
        except LeaseHeld as exc:     # names the owner, whatever its length
            code, message = grpc.StatusCode.FAILED_PRECONDITION, bounded_message(str(exc))
        except ValueError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        if code is not None:
            context.abort(code, message)
        return worker_pb2.ClaimResponse(instance_id=runner.instance_id, lease_ms=round(granted_s * 1000))

    def PrepareGrammar(self, request, context):
        """Compiles a request's constraint ahead of its first step (in the runner's grammar pool,
        within its time budget); waits here, in an RPC thread, never in a step."""
        runner = self._ready_runner(context)
        self._check_lease(request.lease_epoch, "prepare grammar", context)
        code = message = None
        try:
            runner.prepare_grammar(Constraint(request.constraint.kind, request.constraint.text))
        except FeatureUnavailable as exc:
            code, message = grpc.StatusCode.UNIMPLEMENTED, str(exc)
        except GrammarError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, f"is invalid: {exc.problem}"
        except InvalidStepError as exc:
            code, message = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        if code is not None:
            context.abort(code, message)
        return worker_pb2.PrepareGrammarResponse()


class _LaunchedSteps:
    """One Steps stream's launched steps on their way from its reading thread to its answering one,
    in order; None once the reader is done or the worker stops. Once the stream is closed (answered
    to the end, or cancelled), a step handed over is settled where it is, so it still releases its
    output slot."""

    def __init__(self, settle) -> None:
        self._settle = settle
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def put(self, item) -> None:
        with self._lock:
            if not self._closed:
                self._queue.put(item)
                return
        self._settle(*item)

    def get(self):
        return self._queue.get()

    def end(self) -> None:
        self._queue.put(None)

    def close(self) -> None:
        """No more answers: settles every step handed over and not taken."""
        with self._lock:
            self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._settle(*item)


class WorkerServer:
    def __init__(self, host: str, port: int, *, auth_token: str | None = None,
                 credentials: grpc.ServerCredentials | None = None,
                 max_lease_s: float = DEFAULT_MAX_DURATION_S) -> None:
        self.servicer = WorkerServicer(max_lease_s)
        self.health = health.HealthServicer()
        self.server = grpc.server(
            # A scheduler's step stream (or up to four steps in flight as calls), claims and health,
            # and grammar preparations waiting on their compilation (the scheduler runs a few at a time).
            futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="worker-rpc"),
            interceptors=([TokenAuthInterceptor(auth_token)] if auth_token else []) + [StatusGuardInterceptor()],
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                     # The scheduler pings every 10 s, calls or not, to notice a dead worker
                     # between steps; without these the server answers GOAWAY too_many_pings.
                     ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.min_ping_interval_without_data_ms", 5_000)],
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_server_reflection((WORKER_SERVICE, health.SERVICE_NAME), self.server)
        self.address = f"{host}:{port}"
        bound = (self.server.add_secure_port(self.address, credentials) if credentials
                 else self.server.add_insecure_port(self.address))
        if bound == 0:
            raise OSError(f"cannot listen on {self.address}")
        self._guards = ", ".join(name for name, on in (("TLS", credentials), ("bearer token", auth_token)) if on)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set_health(self, status) -> None:
        for service in ("", WORKER_SERVICE):
            self.health.set(service, status)

    def start(self) -> None:
        self.server.start()
        logger.info("listening on %s (%s)", self.address, self._guards or "plaintext, no token")

    def serve(self, runner: ModelRunner) -> None:
        self.servicer.attach(runner)
        freeze_startup_heap()    # the model's objects: no full collection walks them mid-step
        watch_late_compiles()    # a kernel variant first reached while serving is named in the log
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving %s", WORKER_SERVICE)

    def stop(self, grace: float = 5.0) -> None:
        """Reports NOT_SERVING, lets in-flight calls finish for up to `grace` seconds (a step stream
        ends once the steps it launched are answered), stops."""
        self.health.enter_graceful_shutdown()
        stopped = self.server.stop(grace)     # no new calls from here
        self.servicer.end_streams()
        stopped.wait()
        logger.info("stopped")
