"""A hypothesis state machine drives the scheduler with a fake worker that follows the step
messages and keeps a model KV cache: every slot records the token prefix that produced it,
so a block served from a stale hash entry, a shared block overwritten, or a worker mirror
out of step with the scheduler shows up as a wrong slot. Block accounting is checked after
every rule."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.pb.llm.worker.v1 import worker_pb2
from scheduler_svc.block_manager import BlockManager, hash_block
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.step_message import build_step_request

EOS = 0
VOCAB = range(6)          # few token ids: prompts share prefixes often
LOST = "lost"             # what a slot holds after the worker restarted


@dataclass
class Mirror:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list] = [[None] * block_size for _ in range(num_blocks)]
        self.mirrors: dict[int, Mirror] = {}

    def slot(self, block_ids: list[int], position: int):
        return self.kv[block_ids[position // self.block_size]][position % self.block_size]

    def assert_kv(self, mirror: Mirror) -> None:
        """What attention would read: slot p must hold the KV of tokens[:p+1]."""
        for p in range(mirror.num_computed_tokens):
            assert self.slot(mirror.block_ids, p) == tuple(mirror.token_ids[:p + 1]), p

    def step(self, request: worker_pb2.StepRequest, rng: random.Random) -> dict[int, int]:
        for seq_id in request.finished_seq_ids:
            del self.mirrors[seq_id]
        scheduled = []
        for new in request.new_requests:
            assert new.seq_id not in self.mirrors
            mirror = Mirror(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.assert_kv(mirror)                       # the prefix-cache hit it relies on
            self.mirrors[new.seq_id] = mirror
            scheduled.append((new.seq_id, new.num_scheduled_tokens))
        for cached in request.cached_requests:
            self.mirrors[cached.seq_id].block_ids.extend(cached.new_block_ids)
            scheduled.append((cached.seq_id, cached.num_scheduled_tokens))
        for seq_id, n in scheduled:                      # write every slot, then read
            mirror = self.mirrors[seq_id]
            start = mirror.num_computed_tokens
            assert n >= 1 and start + n <= len(mirror.token_ids)
            assert start + n <= len(mirror.block_ids) * self.block_size
            for p in range(start, start + n):
                self.kv[mirror.block_ids[p // self.block_size]][p % self.block_size] = \
                    tuple(mirror.token_ids[:p + 1])
            mirror.num_computed_tokens += n
        sampled = {}
        for seq_id, _ in scheduled:
            mirror = self.mirrors[seq_id]
            self.assert_kv(mirror)
            if mirror.num_computed_tokens == len(mirror.token_ids):
                sampled[seq_id] = rng.choice(VOCAB)
                mirror.token_ids.append(sampled[seq_id])
        return sampled

    def reset(self) -> None:
        self.mirrors.clear()
        for block in self.kv:
            block[:] = [LOST] * self.block_size


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 12), block_size=st.integers(1, 4),
                budget=st.integers(1, 12), max_num_seqs=st.integers(1, 6),
                threshold=st.integers(0, 3))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, threshold):
        self.block_size = block_size
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                 max_model_len=num_blocks * block_size, block_size=block_size,
                                 long_prefill_token_threshold=threshold)
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(config, self.bm, eos_token_ids=[EOS])
        self.worker = FakeWorker(num_blocks, block_size)
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
        running_before = {s.seq_id for s in self.sched.running}
        output = self.sched.schedule()
        if output.is_empty:
            assert not self.sched.has_unfinished()
            return
        assert output.num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
        assert self.sched.num_running <= self.sched.config.max_num_seqs
        assert set(output.preempted_seq_ids) <= running_before
        sampled = self.worker.step(build_step_request(1, output), random.Random(seed))
        if abort_in_flight is not None and self.sched.running:
            self.sched.abort(self.sched.running[abort_in_flight % self.sched.num_running].seq_id)
        lengths = {s.seq_id: s.num_tokens for s in self.seqs}
        received = self.sched.update(output, sampled)
        for seq in self.seqs:
            got = seq in received
            assert seq.num_tokens == lengths[seq.seq_id] + got
            if got:
                assert seq.token_ids[-1] == sampled[seq.seq_id]
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
    @rule(kind=st.sampled_from(["abort", "stop_string", "worker_restart"]), index=st.integers(0, 100))
    def disrupt(self, kind, index):
        if kind == "abort":
            seq = self.unfinished[index % len(self.unfinished)]
            assert self.sched.abort(seq.seq_id) is seq and seq.is_finished
        elif kind == "stop_string" and self.sched.running:
            seq = self.sched.running[index % self.sched.num_running]
            assert self.sched.finish(seq.seq_id) is seq
        elif kind == "worker_restart":
            self.sched.reset_all_worker_state()
            self.worker.reset()

    @rule(seed=st.integers(0, 2**32))
    def drain(self, seed):
        """Everything admitted finishes: nothing deadlocks, however full the cache is."""
        for i in range(1000):
            if not self.sched.has_unfinished():
                break
            self.run_step(seed + i)
        assert not self.sched.has_unfinished()

    @invariant()
    def blocks_are_accounted(self):
        bm = self.bm
        refs = Counter(b for s in self.sched.running for b in s.block_table)
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
        for seq in self.sched.running:
            mirror = self.worker.mirrors[seq.seq_id]
            assert mirror.token_ids == seq.token_ids and mirror.block_ids == seq.block_table
            assert mirror.num_computed_tokens == seq.num_computed_tokens < seq.num_tokens
        for seq in self.sched.waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            assert seq.block_table == [] and seq.num_computed_tokens == 0


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
