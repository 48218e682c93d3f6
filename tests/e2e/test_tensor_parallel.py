"""The parallel layers split across two gloo ranks on the CPU, joined through the worker's own
rendezvous: greedy generation through ModelRunner equals transformers' (so sharded loading, the
all-reduces and the LM head's gather agree with one unsplit model); rank 0 alone samples
and the other rank's batch follows it, sampled, penalised and constrained requests included, and
every rank takes part in scoring a prompt (the LM head's gather is a collective). Flags and
settings that cannot form a working group are refused; steps enter the runner in step_id order,
whatever order their calls arrive in."""
from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.pb.llm.worker.v1 import worker_pb2 as pb
from scheduler_svc.frontend.tokenizer import load_tokenizer
from tests.support.hf_reference import hf_greedy
from tests.support.procs import free_port
from worker_svc.config import WorkerConfig, add_worker_arguments, worker_config_from_args
from worker_svc.parallel_state import check_same_settings, resolve_backend
from worker_svc.step_order import StepOrder

WORLD_SIZE, NUM_NEW = 2, 6
PROMPTS = {1: [5, 17, 33, 2, 99, 140, 7, 8, 250, 31, 12, 44, 61, 3, 9, 77, 301, 5], 2: [400, 3, 3, 18],
           3: [7, 7, 7, 100, 200]}
SAMPLED = pb.SamplingOptions(temperature=1.0, top_k=20, seed=1234, repetition_penalty=1.3)
SCORED = pb.SamplingOptions(temperature=0.0, prompt_logprobs=True, top_logprobs=3)
LETTERS = pb.Constraint(kind="regex", text="[a-z]{3,40}")


def _rank_main(rank: int, port: int, model_dir: str, results) -> None:
    torch.set_num_threads(1)
    from tests.support.runner_driver import Driver, make_runner
    from worker_svc import parallel_state

    parallel_state.init_tensor_parallel(WorkerConfig(model=model_dir, tensor_parallel_size=WORLD_SIZE, rank=rank,
                                                     dist_init_addr=f"127.0.0.1:{port}"))
    try:
        runner = make_runner(model_dir, tensor_parallel_size=WORLD_SIZE, rank=rank)
        assert (runner.describe().rank, runner.describe().world_size) == (rank, WORLD_SIZE)
        d = Driver(runner)
        reported = {s: [] for s in PROMPTS}

        def step(**work) -> None:
            for seq_id, token in d.step(**work).items():
                reported[seq_id].append(token)

        step(new=[d.new(1, PROMPTS[1], 10, SCORED), d.new(2, PROMPTS[2], 4),
                  d.new(3, PROMPTS[3], 5, SAMPLED, constraint=LETTERS)])
        step(cached=[d.cached(1, 8), d.cached(2), d.cached(3)])     # 1: the rest of its prompt
        for _ in range(NUM_NEW - 1):
            step(cached=[d.cached(s) for s in PROMPTS])
        newest = {s: int(runner.last_sampled[runner.batch.row_of[s]]) for s in PROMPTS}
        scored = [len(o.prompt_logprobs.logprobs) for o in d.outputs if o.prompt_logprobs is not None]
        results.put((rank, reported, newest, scored))
    finally:
        parallel_state.destroy_tensor_parallel()


def test_two_ranks_generate_like_one_model(tiny_model_dir):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(free_port(), str(tiny_model_dir), queue), nprocs=WORLD_SIZE)
    results = {rank: rest for rank, *rest in (queue.get() for _ in range(WORLD_SIZE))}
    (reported, newest0, scored0), (other, newest1, scored1) = results[0], results[1]
    greedy = {s: hf_greedy(tiny_model_dir, PROMPTS[s], len(reported[s])) for s in (1, 2)}
    assert {s: reported[s] for s in greedy} == greedy and len(reported[1]) == NUM_NEW
    assert len(reported[3]) == NUM_NEW + 1
    # Rank 1 samples nothing itself: it takes rank 0's tokens, and feeds its next decodes from them.
    assert other == reported
    assert newest1 == newest0 == {s: tokens[-1] for s, tokens in reported.items()}
    assert scored0 == [10, 7] and scored1 == []   # 17 prompt tokens scored over two chunks, on rank 0
    letters = [t for t in reported[3] if t not in (0, 2)]   # the checkpoint's EOS ids end the grammar
    text = load_tokenizer(tiny_model_dir).decode(letters)
    assert text.isascii() and text.isalpha() and text.islower(), text


def _speculating_rank(rank: int, port: int, model_dir: str, method: str, head_dir: str, results) -> None:
    torch.set_num_threads(1)
    from tests.support.runner_driver import GREEDY, make_runner
    from tests.support.speculative_loop import Loop
    from worker_svc import parallel_state

    parallel_state.init_tensor_parallel(WorkerConfig(model=model_dir, tensor_parallel_size=WORLD_SIZE, rank=rank,
                                                     dist_init_addr=f"127.0.0.1:{port}"))
    try:
        runner = make_runner(model_dir, tensor_parallel_size=WORLD_SIZE, rank=rank, speculative_method=method,
                             speculative_model=head_dir, num_speculative_tokens=3)
        loop = Loop(runner)
        outputs = loop.run({s: (PROMPTS[s], GREEDY) for s in PROMPTS}, 10)
        results.put((rank, outputs, loop.num_verified, loop.num_accepted))
    finally:
        parallel_state.destroy_tensor_parallel()


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_two_ranks_speculate_with_a_model_on_the_device_like_one(tiny_model_dir, tiny_self_draft_dir,
                                                                   tiny_eagle3_dir, method):
    """The proposer is split as the target is (a draft model's layers, the EAGLE-3 head's
    attention, MLP and vocabulary), and every rank learns each draft without gathering logits:
    greedy output equals transformers', both ranks verify and accept the same drafts, and the
    target's own weights as the draft model have their drafts accepted."""
    head = tiny_self_draft_dir if method == "draft" else tiny_eagle3_dir
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_speculating_rank, args=(free_port(), str(tiny_model_dir), method, str(head), queue), nprocs=WORLD_SIZE)
    results = {rank: rest for rank, *rest in (queue.get() for _ in range(WORLD_SIZE))}
    (outputs, verified, accepted), other = results[0], results[1]
    for seq_id, p in PROMPTS.items():
        assert outputs[seq_id] == hf_greedy(tiny_model_dir, p, 10), f"{method}, sequence {seq_id}"
    assert list(other) == [outputs, verified, accepted] and verified >= 6
    if method == "draft":
        assert accepted >= 0.9 * 3 * verified


def test_flags_that_cannot_form_a_group_are_refused():
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    for flags, message in [(["--tensor-parallel-size", "2"], "--dist-init-addr"),
                           (["--tensor-parallel-size", "2", "--rank", "2", "--dist-init-addr", "h:1"], "--rank"),
                           (["--tensor-parallel-size", "2", "--dist-init-addr", "h"], "HOST:PORT"),
                           (["--dist-timeout", "0"], "--dist-timeout")]:
        with pytest.raises(ValueError, match=message):
            worker_config_from_args(parser.parse_args(["--model", "m", *flags]))
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="cuda"):
        resolve_backend("nccl", torch.device("cpu"))


def test_ranks_must_share_the_settings_that_decide_a_step():
    store = dist.HashStore()
    rank_0 = WorkerConfig(model="m", tensor_parallel_size=2, rank=0, dist_init_addr="h:1", block_size=16)
    check_same_settings(store, rank_0)
    check_same_settings(store, dataclasses.replace(rank_0, rank=1, num_kv_blocks=100, device="cuda:1"))
    with pytest.raises(ValueError, match="same settings"):
        check_same_settings(store, dataclasses.replace(rank_0, rank=1, block_size=32))


def _start_steps(order: StepOrder, step_ids: list[int]) -> tuple[list[threading.Thread], list[int]]:
    """Starts a thread per step, in the given order, each a little after the last; returns the
    threads and the list the steps append their ids to as they run."""
    ran = []

    def run(step_id: int) -> None:
        with order.step(step_id):
            ran.append(step_id)
            time.sleep(0.02)   # so that the later ones queue up behind it

    threads = [threading.Thread(target=run, args=(step_id,)) for step_id in step_ids]
    for thread in threads:
        thread.start()
        time.sleep(0.005)
    return threads, ran


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=10)


def _run_steps(order: StepOrder, step_ids: list[int]) -> list[int]:
    """Starts the steps as _start_steps does; returns the order in which they ran."""
    threads, ran = _start_steps(order, step_ids)
    _join(threads)
    return ran


def test_steps_run_one_at_a_time_in_step_id_order():
    order = StepOrder(wait_s=5.0)
    start = time.monotonic()
    assert _run_steps(order, [2, 3, 1]) == [1, 2, 3]        # step 1 comes first after a start
    assert _run_steps(order, [6, 5, 4]) == [4, 5, 6]
    assert _run_steps(order, [1]) == [1]                     # a lower id: a new scheduler's count
    with order.exclusive():                                  # a Reset: step 1 is next again
        pass
    assert _run_steps(order, [2, 1]) == [1, 2]
    assert time.monotonic() - start < 4.5                    # no step waited out its time (5 s)
    impatient = StepOrder(wait_s=0.3)
    start = time.monotonic()
    # Numbered otherwise: the lowest first, also once the later arrival's wait is over (8 waits
    # for 7). Both must have arrived within wait_s of each other, which a loaded machine may not
    # grant to threads started 5 ms apart; so they arrive while the order is held (a Reset), which
    # lets go as soon as both wait, well within their 0.3 s (or, later, with both waits over: the
    # lowest must still go first).
    with impatient.exclusive():
        threads, ran = _start_steps(impatient, [8, 7])
        deadline = time.monotonic() + 60
        while impatient._waiting != {7, 8}:
            assert time.monotonic() < deadline, "the steps never arrived"
            time.sleep(0.001)
    _join(threads)
    assert ran == [7, 8]
    assert _run_steps(impatient, [10]) == [10]               # step 9 never comes: 10 runs anyway
    assert 0.6 <= time.monotonic() - start < 4.5           # two waits of 0.3 s, not forever


def test_a_named_barrier_holds_every_round_not_only_the_first():
    """Two ranks pass a barrier of one name three times; the second rank's second pass waits for
    the first rank, which arrives only after recording its work (a barrier that released once and
    then stayed open would let the second rank through first)."""
    from worker_svc.parallel_state import _store_barrier

    store = dist.HashStore()
    order = []

    def first():
        _store_barrier(store, "measured", 2)
        time.sleep(0.3)
        order.append("first rank's work")
        _store_barrier(store, "measured", 2)
        _store_barrier(store, "measured", 2)

    def second():
        _store_barrier(store, "measured", 2)
        _store_barrier(store, "measured", 2)
        order.append("second rank past round two")
        _store_barrier(store, "measured", 2)

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert order == ["first rank's work", "second rank past round two"]
