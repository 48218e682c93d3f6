"""A hypothesis state machine drives the scheduler with a fake worker (tests/support/fake_worker.py)
whose model KV cache records, in every slot, the token prefix that produced it: a block served
from a stale hash entry, a shared block overwritten, or a worker mirror out of step with the
scheduler shows up as a wrong slot. Block accounting is checked after every rule. The machine runs synchronously (each step's result applied before the next is
scheduled) and with a step in flight (the next one scheduled first, as the engine's async
scheduling does); a last property checks that both give every request the same tokens. Both run
again with speculative decoding: the fake worker proposes drafts, some right and some wrong, and
verifies them as the real one does (a step with drafts is applied before the next is scheduled)."""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.engine.block_manager import BlockManager, hash_block
from common.sampling import SamplingParams
from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.scheduler_output import SchedulerOutput
from scheduler_svc.engine.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_svc.engine.speculation import SpeculationConfig
from scheduler_svc.engine.step_message import build_step_request
from tests.support.fake_worker import FakeWorker, prefix_token

EOS = 0
VOCAB = range(6)          # few token ids: prompts share prefixes often


def guess(tokens: list[int], k: int, seed: int) -> list[int]:
    """k drafts for a worker whose sampler is prefix_token: its true continuation, with one token
    (chosen by the seed and the prefix) wrong unless that choice falls past the k."""
    drafts = []
    wrong_at = hash_block(seed, tokens) % (k + 2)
    for j in range(k):
        true = prefix_token(tokens + drafts, len(VOCAB))
        drafts.append((true + 1) % len(VOCAB) if j == wrong_at else true)
    return drafts


class SchedulerMachine(RuleBasedStateMachine):
    # Steps scheduled before the oldest result is applied: 1 is synchronous.
    depth = 1
    num_speculative_tokens = 0

    @initialize(num_blocks=st.integers(3, 12), block_size=st.integers(1, 4),
                budget=st.integers(1, 12), max_num_seqs=st.integers(1, 6),
                threshold=st.integers(0, 3), max_speculative_batch=st.integers(1, 6),
                held_beyond=st.integers(-1, 3))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, threshold, max_speculative_batch, held_beyond):
        self.block_size = block_size
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                 max_model_len=num_blocks * block_size, block_size=block_size,
                                 long_prefill_token_threshold=threshold,
                                 speculation=SpeculationConfig(self.num_speculative_tokens, max_speculative_batch),
                                 # -1: the worker states no bound
                                 max_held_requests=max_num_seqs + held_beyond if held_beyond >= 0 else 0)
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(config, self.bm, eos_token_ids=[EOS])
        self.worker = FakeWorker(num_blocks, block_size, self.num_speculative_tokens,
                                 lambda tokens: guess(tokens, self.num_speculative_tokens, len(tokens)))
        # Steps the worker has run (it runs each when it is sent) whose results are not applied:
        # the output, the tokens, the tokens per sampling request, the drafts it holds and verified.
        self.in_flight: list[tuple[SchedulerOutput, list[int], list[int], list[int], list[int]]] = []
        self.running_since_sent: set[int] = set()
        self.seqs: list[Sequence] = []
        self.prefix_by_hash: dict[int, tuple[int, ...]] = {}
        self.next_id = 1

    @property
    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @rule(base=st.integers(0, 100), suffix=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=9),
          max_tokens=st.integers(1, 12), min_tokens=st.integers(0, 2), ignore_eos=st.booleans(),
          stop_token_ids=st.lists(st.sampled_from(VOCAB), max_size=1))
    def add(self, base, suffix, max_tokens, min_tokens, ignore_eos, stop_token_ids):
        # Often continue a known sequence (prompt and output), so prefix hits are common.
        prefix = self.seqs[base % len(self.seqs)].token_ids if self.seqs and base % 2 else []
        prompt = (prefix + suffix)[:self.sched.config.max_model_len]
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                                stop_token_ids=tuple(stop_token_ids))
        seq = Sequence(self.next_id, f"r{self.next_id}", prompt, params)
        self.next_id += 1
        self.sched.add(seq)
        self.seqs.append(seq)
        self.record_prefixes(seq)

    def run_step(self, seed: int, abort_in_flight: int | None = None) -> None:
        """Schedules and sends one step; applies the oldest result once `depth` steps are in
        flight, or when nothing more could be scheduled."""
        # A step that schedules nothing sends nothing: its preemptions go with the next one.
        self.note_on_worker()
        output = self.sched.schedule()
        if output.is_empty:
            if not self.in_flight:
                assert all(s.paused for s in self.unfinished)     # paused ones wait for resume()
                return
        else:
            self.assert_writes_land_in_blocks_of_their_own(output)
            assert output.num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
            assert self.sched.num_running <= self.sched.config.max_num_seqs
            assert set(output.preempted_seq_ids) <= self.running_since_sent
            self.running_since_sent = set()
            rng = random.Random(seed)
            # Mostly the prefix's own token, so that drafts (its true continuation) are often right.
            sampled = self.worker.step(build_step_request(1, output), lambda tokens: rng.choice(
                [prefix_token(tokens, len(VOCAB))] * 3 + list(VOCAB)))
            self.in_flight.append((output, sampled, self.worker.token_counts, self.worker.num_drafts,
                                   self.worker.verified_drafts))
        if abort_in_flight is not None and self.sched.running:
            self.sched.abort(self.sched.running[abort_in_flight % self.sched.num_running].seq_id)
        if output.is_empty or len(self.in_flight) == self.depth:
            self.apply_oldest()

    def assert_writes_land_in_blocks_of_their_own(self, output: SchedulerOutput) -> None:
        """Every K/V slot a step writes lies in a block that its request alone holds (blocks are
        shared only once full and computed): no request of the step reads a slot another one writes
        in it. The pure-decode attention launch that stores each new key itself relies on this
        (worker_svc/layers/attention/decode_qk.py), as any worker that stores and reads in one pass would."""
        # (ref_count is the holders' count: blocks_are_accounted checks that after every rule)
        for seq, num_scheduled, num_computed in zip(output.seqs, output.num_scheduled, output.num_computed):
            for position in range(num_computed, num_computed + num_scheduled):
                assert self.bm.blocks[seq.block_table[position // self.block_size]].ref_count == 1, (seq, position)

    def note_on_worker(self) -> None:
        """Remembers which requests the worker holds now: only those can be named as preempted
        in the next step sent (a resume or a pause may preempt a paused one before it is sent)."""
        self.running_since_sent |= {s.seq_id for s in self.unfinished if s.on_worker}

    def apply_oldest(self) -> None:
        output, sampled, counts, drafts, verified = self.in_flight.pop(0)
        lengths = {s.seq_id: s.num_tokens for s in self.seqs}
        received = self.sched.update(output, sampled, counts, drafts, verified)
        runs, offset = {}, 0
        for seq, n in zip(output.sampling_seqs, counts or [1] * len(output.sampling_seqs)):
            runs[seq.seq_id] = sampled[offset:offset + n]
            offset += n
        got = dict(zip([s.seq_id for s in received], output.received_counts or [1] * len(received)))
        for seq in self.seqs:
            n = got.get(seq.seq_id, 0)
            assert seq.num_tokens == lengths[seq.seq_id] + n
            if n:
                assert seq.token_ids[-n:] == runs[seq.seq_id][:n]
                # A run is cut only where the request finished.
                assert n == len(runs[seq.seq_id]) or seq.is_finished
        for seq in received:
            self.record_prefixes(seq)

    def record_prefixes(self, seq: Sequence) -> None:
        """The test's own map from block hash to the whole token prefix it stands for."""
        bs, h = self.block_size, None
        for end in range(bs, seq.num_tokens + 1, bs):
            h = hash_block(h, seq.token_ids[end - bs:end])
            self.prefix_by_hash[h] = tuple(seq.token_ids[:end])

    @rule(seed=st.integers(0, 2**32), num_steps=st.integers(1, 4),
          abort_in_flight=st.none() | st.integers(0, 10))
    def step(self, seed, num_steps, abort_in_flight):
        for i in range(num_steps):
            self.run_step(seed + i, abort_in_flight if i == 0 else None)

    # One rule for the rarer events, so that steps and arrivals make up most of a run.
    @precondition(lambda self: self.unfinished)
    @rule(kind=st.sampled_from(["abort", "stop_string", "worker_restart", "pause", "resume"]),
          index=st.integers(0, 100))
    def disrupt(self, kind, index):
        if kind == "abort":
            seq = self.unfinished[index % len(self.unfinished)]
            assert self.sched.abort(seq.seq_id) is seq and seq.is_finished
        elif kind == "stop_string" and self.sched.running:
            seq = self.sched.running[index % self.sched.num_running]
            assert self.sched.finish(seq.seq_id) is seq
        elif kind == "worker_restart":             # the results in flight are lost with it
            self.sched.reset_all_worker_state()
            self.worker.reset()
            self.in_flight.clear()
        elif kind == "pause":                      # its client stopped reading (backpressure)
            seq = self.unfinished[index % len(self.unfinished)]
            self.note_on_worker()                  # past max_held_requests a paused one is preempted
            assert self.sched.pause(seq.seq_id) != seq.paused or seq.paused
            assert seq.paused and seq not in self.sched.running and seq not in self.sched.waiting
        elif kind == "resume" and self.sched.paused:
            seq = list(self.sched.paused.values())[index % self.sched.num_paused]
            self.note_on_worker()
            assert self.sched.resume(seq.seq_id) and not seq.paused
            assert (seq in self.sched.running) != (seq in self.sched.waiting)

    @rule(seed=st.integers(0, 2**32))
    def drain(self, seed):
        """Everything admitted finishes: nothing deadlocks, however full the cache is (once the
        paused requests are resumed: until then they wait by design)."""
        self.note_on_worker()
        for seq_id in list(self.sched.paused):
            self.sched.resume(seq_id)
        for i in range(1000):
            if not self.sched.has_unfinished() and not self.in_flight:
                break
            self.run_step(seed + i)
        assert not self.sched.has_unfinished() and not self.in_flight

    @invariant()
    def blocks_are_accounted(self):
        bm = self.bm
        refs = Counter(b for s in self.sched.running + list(self.sched.paused.values()) for b in s.block_table)
        free = set(bm.free_block_ids)
        for block in bm.blocks:
            assert block.ref_count == refs[block.block_id]
            assert (block.ref_count == 0) == (block.block_id in free)
        assert len(free) == bm.num_free_blocks and bm.num_free_blocks + len(refs) == bm.num_blocks
        if not self.sched.has_unfinished():
            assert bm.num_free_blocks == bm.num_blocks

    @invariant()
    def hash_entries_serve_the_right_kv(self):
        bs = self.block_size
        for h, block_id in self.bm.hash_to_block_id.items():
            block = self.bm.blocks[block_id]
            prefix = self.prefix_by_hash[h]
            assert block.hash == h and list(prefix[-bs:]) == block.token_ids
            start = len(prefix) - bs
            assert [self.worker.kv[block_id][j] for j in range(bs)] == \
                [prefix[:start + j + 1] for j in range(bs)]

    @invariant()
    def worker_mirrors_match(self):
        """The worker is ahead by the steps in flight: the tokens they sampled (one placeholder each
        here) and the drafts they accepted (unresolved here)."""
        holding = self.sched.running + [s for s in self.sched.paused.values() if s.status is SequenceStatus.RUNNING]
        for seq in holding:
            mirror = self.worker.mirrors[seq.seq_id]
            runs = [counts[j] if counts else 1 for output, _, counts, *_ in self.in_flight
                    for j, s in enumerate(output.sampling_seqs)
                    if s is seq and output.sampling_admissions[j] == seq.num_admissions]
            assert mirror.token_ids[:seq.num_tokens] == seq.token_ids
            assert len(mirror.token_ids) == seq.num_tokens + sum(runs)
            assert mirror.block_ids == seq.block_table
            accepted = sum(runs) - len(runs)
            assert mirror.num_computed_tokens == seq.num_computed_tokens + accepted < len(mirror.token_ids)
            assert accepted <= seq.num_unresolved_drafts
            assert seq.num_placeholder_tokens == sum(
                1 for output, *_ in self.in_flight for s in output.scheduled
                if s.seq is seq and s.num_admissions == seq.num_admissions and s.samples)
        released = [s for s in self.sched.paused.values() if s.status is not SequenceStatus.RUNNING]
        for seq in list(self.sched.waiting) + released:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            assert seq.block_table == [] and seq.num_computed_tokens == seq.num_placeholder_tokens == 0
        for seq in self.sched.paused.values():
            assert seq.paused and not seq.is_finished

    @invariant()
    def the_worker_holds_no_more_requests_than_it_said(self):
        """Running and paused mirrors within WorkerInfo.max_held_requests (mirrors to drop go
        first in the next step sent, before any request it adds)."""
        if self.sched.config.max_held_requests:
            assert sum(s.on_worker for s in self.unfinished) <= self.sched.config.max_held_requests


class AsyncSchedulerMachine(SchedulerMachine):
    depth = 2


class SpeculativeSchedulerMachine(SchedulerMachine):
    num_speculative_tokens = 3


class AsyncSpeculativeSchedulerMachine(SpeculativeSchedulerMachine):
    depth = 2


_machine_settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
for _machine in (SchedulerMachine, AsyncSchedulerMachine, SpeculativeSchedulerMachine,
                 AsyncSpeculativeSchedulerMachine):
    _machine.TestCase.settings = _machine_settings
TestSchedulerMachine = SchedulerMachine.TestCase
TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase
TestSpeculativeSchedulerMachine = SpeculativeSchedulerMachine.TestCase
TestAsyncSpeculativeSchedulerMachine = AsyncSpeculativeSchedulerMachine.TestCase


def run_to_completion(requests, arrivals, num_blocks: int, block_size: int, budget: int,
                      depth: int, num_speculative_tokens: int = 0) -> list[tuple[list[int], FinishReason]]:
    """Runs the requests (prompt, params, stop_after) through a scheduler and a fake worker,
    each arriving before the step numbered in arrivals, with `depth` steps in flight at most.
    stop_after finishes a request as a stop string would, once it has that many tokens (tokens a
    run brought past it are the frontend's to drop, as it drops the text after a stop string)."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                             max_model_len=num_blocks * block_size, block_size=block_size,
                             speculation=SpeculationConfig(num_speculative_tokens, max_batch_size=3))
    sched = Scheduler(config, BlockManager(num_blocks, block_size), eos_token_ids=[EOS])
    worker = FakeWorker(num_blocks, block_size, num_speculative_tokens,
                        lambda tokens: guess(tokens, num_speculative_tokens, 7))
    seqs = [Sequence(i, f"r{i}", prompt, params) for i, (prompt, params, _) in enumerate(requests)]
    in_flight: list[tuple[SchedulerOutput, list[int], list[int], list[int], list[int]]] = []

    def apply_oldest() -> None:
        output, sampled, counts, drafts, verified = in_flight.pop(0)
        for seq in sched.update(output, sampled, counts, drafts, verified):
            stop_after = requests[seq.seq_id][2]
            if not seq.is_finished and stop_after is not None and seq.num_output_tokens >= stop_after:
                sched.finish(seq.seq_id)

    for step_index in range(10_000):
        for seq, arrival in zip(seqs, arrivals):
            if arrival == step_index:
                sched.add(seq)
        if not sched.has_unfinished() and not in_flight and step_index > max(arrivals):
            break
        output = sched.schedule()
        if not output.is_empty:
            sampled = worker.step(build_step_request(step_index, output), lambda t: prefix_token(t, len(VOCAB)))
            in_flight.append((output, sampled, worker.token_counts, worker.num_drafts, worker.verified_drafts))
        if in_flight and (output.is_empty or len(in_flight) == depth):
            apply_oldest()
    assert all(seq.is_finished for seq in seqs)
    outputs = []
    for seq, (_, _, stop_after) in zip(seqs, requests):
        if stop_after is not None and seq.num_output_tokens >= stop_after:   # as the client sees it
            outputs.append((seq.output_token_ids[:stop_after], FinishReason.STOP))
        else:
            outputs.append((seq.output_token_ids, seq.finish_reason))
    return outputs


_request = st.tuples(
    st.lists(st.sampled_from(VOCAB), min_size=1, max_size=10),
    st.builds(SamplingParams, max_tokens=st.integers(1, 10), min_tokens=st.integers(0, 2),
              ignore_eos=st.booleans()),
    st.none() | st.integers(1, 6),
)


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(_request, min_size=1, max_size=8), data=st.data(),
       num_blocks=st.integers(5, 10), block_size=st.integers(1, 4), budget=st.integers(1, 12))
def test_a_step_in_flight_changes_no_request_s_tokens(requests, data, num_blocks, block_size, budget):
    """Scheduled ahead or not, with preemptions and early stops, each request gets the same
    tokens and the same finish reason."""
    max_len = num_blocks * block_size
    requests = [(prompt[:max_len], params, stop_after) for prompt, params, stop_after in requests]
    arrivals = data.draw(st.lists(st.integers(0, 12), min_size=len(requests), max_size=len(requests)))
    sync = run_to_completion(requests, arrivals, num_blocks, block_size, budget, depth=1)
    assert run_to_completion(requests, arrivals, num_blocks, block_size, budget, depth=2) == sync


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(_request, min_size=1, max_size=8), data=st.data(),
       num_blocks=st.integers(5, 10), block_size=st.integers(1, 4), budget=st.integers(1, 12),
       num_speculative_tokens=st.integers(1, 4))
def test_speculative_decoding_changes_no_request_s_tokens(requests, data, num_blocks, block_size, budget,
                                                          num_speculative_tokens):
    """With drafts proposed and verified (some right, some wrong), scheduled ahead or not, with
    preemptions, stops inside accepted runs and early stops, each request gets the same tokens
    and the same finish reason as without."""
    max_len = num_blocks * block_size
    requests = [(prompt[:max_len], params, stop_after) for prompt, params, stop_after in requests]
    arrivals = data.draw(st.lists(st.integers(0, 12), min_size=len(requests), max_size=len(requests)))
    plain = run_to_completion(requests, arrivals, num_blocks, block_size, budget, depth=1)
    for depth in (1, 2):
        assert run_to_completion(requests, arrivals, num_blocks, block_size, budget, depth,
                                 num_speculative_tokens) == plain


def test_a_pause_past_the_held_bound_preempts_a_request_the_worker_held():
    """Found by the state machine: with one slot and nothing held beyond it, pausing the one running
    request drops its mirror at once; the step that resumes it names it as preempted."""
    state = SchedulerMachine()
    state.setup(num_blocks=3, block_size=1, budget=1, max_num_seqs=1, threshold=0, max_speculative_batch=1,
                held_beyond=0)
    state.add(base=0, ignore_eos=False, max_tokens=1, min_tokens=0, stop_token_ids=[], suffix=[0, 0])
    state.step(abort_in_flight=None, num_steps=1, seed=0)
    state.disrupt(index=0, kind="pause")
    state.the_worker_holds_no_more_requests_than_it_said()
    state.worker_mirrors_match()
    state.drain(seed=0)
    state.teardown()
