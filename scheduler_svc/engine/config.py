"""The engine core's settings: one dataclass whose fields are also the scheduler's flags
(common.cli.flag: default, help and QWEN3_SERVE_* variable in one place)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from common.cli import flag
from common.speculation import DEFAULT_MAX_BATCH_SIZE, METHODS

ENGINE = "engine core"
THIRD_STEP_MAX_SEQS = 32   # EngineConfig.third_step_max_seqs's default (bench/stages/decode.py follows it)
FOURTH_STEP_MAX_SEQS = 4   # EngineConfig.fourth_step_max_seqs's default (likewise)
MOST_STEPS_IN_FLIGHT = 4   # what the workers hold buffers for (worker_svc/staging.py, tools/offline.py)


def steps_in_flight(requests: int, third_step_max_seqs: int, fourth_step_max_seqs: int) -> int:
    """How many steps async scheduling keeps in flight (without speculative decoding) while `requests`
    run or wait: MOST_STEPS_IN_FLIGHT up to the fourth step's bound (at most the third's), 3 up to the
    third's, else 2 (either bound 0: that step never)."""
    if not third_step_max_seqs or requests > third_step_max_seqs:
        return 2
    return MOST_STEPS_IN_FLIGHT if fourth_step_max_seqs and requests <= fourth_step_max_seqs else 3


@dataclass
class EngineConfig:
    max_num_seqs: int | None = flag(
        None, group=ENGINE, help="most requests in one step (unset: what the workers report, their --max-num-seqs; "
                                 "more than a worker takes is refused when it connects)")
    max_num_batched_tokens: int | None = flag(
        None, group=ENGINE, help="token budget of one step; longer prompts are prefilled in chunks, mixed with "
                                 "decodes (unset: what the workers report, their --max-num-batched-tokens, which "
                                 "defaults by device; more than a worker takes is refused when it connects)")
    max_model_len: int | None = flag(None, group=ENGINE, help="context limit (unset: the workers' limit)")
    max_waiting: int = flag(4096, group=ENGINE,
                            help="waiting-queue bound; past it requests get RESOURCE_EXHAUSTED")
    step_timeout_s: float = flag(300.0, name="--step-timeout", group=ENGINE,
                                 help="seconds before a silent worker is declared down")
    reconnect_interval_s: float = 0.5
    idle_probe_interval_s: float = 1.0    # how often an idle group checks its workers are alive
    idle_probe_timeout_s: float = 2.0
    # Schedule and send step N+1 while the worker runs step N, so it never waits for the
    # round trip and the scheduler's per-step work (vLLM's async scheduling). Needs workers
    # that run steps in the order sent, as the gRPC worker and LocalWorkerClient do.
    async_scheduling: bool = flag(True, group=ENGINE, help="wait for each step's reply before scheduling the next "
                                                           "(without it: one step ahead)")
    # With async scheduling a third step is sent while few requests run: a small batch's device
    # step (~1.2 ms for Qwen3-0.6B at one row) can be shorter than the host's round trip (reply
    # out, update, schedule, the step message in, the worker's prepare and launch: 1.0-1.8 ms by
    # host), and with two in flight the device then waits for it (docs/PERF_NOTES.md v39). Not
    # with speculative decoding (a verifying step's drafts come from the step before it).
    third_step_max_seqs: int = flag(
        THIRD_STEP_MAX_SEQS, group=ENGINE, metavar="N",
        help="with async scheduling, keep a third step in flight while at most N requests run or wait (small "
             "batches' device steps are shorter than the host's round trip; not with speculative decoding; 0: never)")
    # And a fourth at the fewest requests: through the service (a client's stream, the frontends, the engine
    # core's loop) the round trip took 2.3 ms of a single stream's 1.1-ms device steps on an H100 (PERF_NOTES
    # v47), longer than two steps, and the device waited for it.
    fourth_step_max_seqs: int = flag(
        FOURTH_STEP_MAX_SEQS, group=ENGINE, metavar="N",
        help="with async scheduling, keep a fourth step in flight while at most N requests run or wait (bounded by "
             "the third step's N; a stream or a few: the service's round trip outlasts two of their device steps; not "
             "with speculative decoding; 0: never)")
    # One Steps stream per worker rank rather than a call per step: a stream's message costs the worker and
    # this process about half a call's host work, which a one-row step feels (docs/PERF_NOTES.md v54).
    step_stream: bool = flag(True, group=ENGINE,
                             help="send each step to the workers as its own Step call rather than over one Steps stream "
                                  "(the stream costs less host work a step)")
    step_log: str | None = flag(
        None, group=ENGINE, metavar="PATH",
        help="append a line per step to PATH (its time from the previous reply, the worker's device time, its "
             "sequences and tokens: scheduler_svc/engine/step_log.py), for finding where a run's time goes")
    # Whose workers these are: the identity this scheduler leases them under; another identity
    # waits until worker_lease_s pass without a step or renewal. None: HOSTNAME:PID.
    instance_id: str | None = flag(
        None, group=ENGINE, help="this scheduler's identity, under which it leases its workers (unset: HOSTNAME:PORT, "
                                 "stable across restarts, so a restarted scheduler re-claims its workers at once)")
    worker_lease_s: float = flag(10.0, name="--worker-lease", group=ENGINE,
                                 help="seconds a worker stays leased to this scheduler without a step or renewal; "
                                      "another scheduler can take it over only after that")
    priority_aging_s: float = flag(
        0.01, name="--priority-aging", group=ENGINE, metavar="SECONDS",
        help="seconds of waiting one priority level is worth: a waiting request is admitted before any that arrives "
             "more than (its priority - theirs) x this later, so with priorities in -N..N (--max-priority) none "
             "waits behind later arrivals for more than 2N x this (0: strict priority)")
    # Grammars the group's rank 0 compiles at once for requests about to be queued (it has a pool
    # of processes for them); the others wait their turn in the core.
    grammar_prepare_concurrency: int = 2
    # A request blamed for this many failed steps is failed alone rather than re-sent once more
    # (the suspects of a failed step come back one at a time, so the next failure is one's own).
    max_request_failures: int = flag(
        2, group=ENGINE, help="a request in this many failed steps (the worker reset each time) is failed alone, with "
                              "INTERNAL naming the worker's error, instead of being re-sent again")

    # Speculative decoding: the workers propose drafts (their --speculative-method); these choose
    # how the scheduler uses them.
    speculative_method: str | None = flag(
        None, group=ENGINE, choices=(*METHODS, "off"),
        help="speculative decoding: the workers' proposer, checked against what they report (unset: whatever "
             "they propose, if anything; off: never speculate)")
    num_speculative_tokens: int | None = flag(
        None, group=ENGINE, help="most draft tokens a decode verifies in one step (unset: the workers' "
                                 "--num-speculative-tokens; more is refused when they connect)")
    speculative_max_batch_size: int = flag(
        DEFAULT_MAX_BATCH_SIZE, group=ENGINE,
        help="a step speculates only while at most this many requests run; larger batches decode one token "
             "per step, scheduled ahead (docs/SPECULATIVE.md has the measurement)")

    def __post_init__(self) -> None:
        if self.instance_id is None:
            self.instance_id = f"{socket.gethostname()}:{os.getpid()}"
