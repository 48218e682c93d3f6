"""A model of the worker for scheduler tests: it follows the step messages as the real one does
(request mirrors, appended samples) and keeps a model KV cache in which every slot records the
token prefix that produced it, so wrong KV (a stale prefix-cache hit, a shared block overwritten,
a mirror out of step with the scheduler) shows up as a wrong slot."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from common.constraint import Constraint
from common.pb.llm.worker.v1 import worker_pb2
from scheduler_svc.engine.block_manager import hash_block
from scheduler_svc.engine.worker_client import WorkerError
from worker_svc.lease import LeaseError, WorkerLease

LOST = "lost"             # what a slot holds after the worker restarted


def prefix_token(tokens: list[int], vocab_size: int) -> int:
    """A sampler that picks a function of the whole prefix, like greedy decoding or a seed per
    (request, output index): every request's tokens are then fixed, whatever the batches."""
    return hash_block(None, tokens) % vocab_size


@dataclass
class Mirror:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    drafts: list[int] = field(default_factory=list)   # proposed for its next step


class FakeWorker:
    """With num_speculative_tokens, it proposes drafts (`propose(tokens)`) when a step asks and
    verifies them as the real worker does: it samples at the newest token and at each draft, and
    a request gets its samples up to the first that differs from the next draft."""

    def __init__(self, num_blocks: int, block_size: int, num_speculative_tokens: int = 0,
                 propose: Callable[[list[int]], list[int]] | None = None) -> None:
        self.block_size = block_size
        self.kv: list[list] = [[None] * block_size for _ in range(num_blocks)]
        self.mirrors: dict[int, Mirror] = {}
        self.num_speculative_tokens = num_speculative_tokens
        self.propose = propose
        # The last step's reply beyond its tokens: tokens and drafts verified per sampling request
        # (empty: one each, none verified) and drafts held per sampling request (empty: none proposed).
        self.token_counts: list[int] = []
        self.verified_drafts: list[int] = []
        self.num_drafts: list[int] = []

    def slot(self, block_ids: list[int], position: int):
        return self.kv[block_ids[position // self.block_size]][position % self.block_size]

    def assert_kv(self, mirror: Mirror) -> None:
        """What attention would read: slot p must hold the KV of tokens[:p+1]."""
        for p in range(mirror.num_computed_tokens):
            assert self.slot(mirror.block_ids, p) == tuple(mirror.token_ids[:p + 1]), p

    def step(self, request: worker_pb2.StepRequest, sample: Callable[[list[int]], int]) -> list[int]:
        """Runs a step as the real worker does; sample(tokens) picks the next token. Returns the
        tokens of each request that samples, in batch order (cached requests, then new ones):
        one each, or token_counts[i] for request i when the step verified drafts."""
        for seq_id in request.finished_seq_ids:
            del self.mirrors[seq_id]
        cached = request.cached
        counts = dict(zip(cached.multi_token_indices, cached.multi_token_counts))
        drafts = dict(zip(cached.draft_indices, cached.draft_counts))
        new_blocks, offset = {}, 0
        for index, count in zip(cached.new_block_indices, cached.new_block_counts):
            new_blocks[index] = list(cached.new_block_ids[offset:offset + count])
            offset += count
        scheduled = []
        for i, seq_id in enumerate(cached.seq_ids):
            mirror = self.mirrors[seq_id]
            mirror.block_ids.extend(new_blocks.get(i, []))
            # It verifies the drafts it holds, up to the count asked.
            scheduled.append((seq_id, counts.get(i, 1), min(drafts.get(i, 0), len(mirror.drafts))))
        for new in request.new_requests:
            assert new.seq_id not in self.mirrors
            mirror = Mirror(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.assert_kv(mirror)                       # the prefix-cache hit it relies on
            self.mirrors[new.seq_id] = mirror
            scheduled.append((new.seq_id, new.num_scheduled_tokens, 0))
        for seq_id, n, k in scheduled:                   # write every slot, then read
            mirror = self.mirrors[seq_id]
            start = mirror.num_computed_tokens
            assert n >= 1 and start + n <= len(mirror.token_ids)
            assert not k or start + n == len(mirror.token_ids)
            assert start + n + k <= len(mirror.block_ids) * self.block_size
            tokens = mirror.token_ids + mirror.drafts[:k]
            for p in range(start, start + n + k):
                self.kv[mirror.block_ids[p // self.block_size]][p % self.block_size] = tuple(tokens[:p + 1])
            mirror.num_computed_tokens += n
        sampled, self.token_counts, self.verified_drafts, self.num_drafts = [], [], [], []
        for seq_id, _, k in scheduled:
            mirror = self.mirrors[seq_id]
            self.assert_kv(mirror)
            if mirror.num_computed_tokens == len(mirror.token_ids):
                run = self._verify(mirror, sample, k)
                sampled += run
                self.token_counts.append(len(run))
                self.verified_drafts.append(k)
                self.num_drafts.append(self._propose(mirror) if request.propose_drafts else 0)
        if not any(self.verified_drafts):
            self.verified_drafts = []
        if all(c == 1 for c in self.token_counts):
            self.token_counts = []
        if not request.propose_drafts:
            self.num_drafts = []
        return sampled

    def _verify(self, mirror: Mirror, sample: Callable[[list[int]], int], k: int) -> list[int]:
        """The samples at the newest token and at each of k drafts, up to the first that differs
        from the next draft; the accepted drafts' KV counts as computed (the rejected ones' slots
        stay in the block table)."""
        run = []
        for j in range(k + 1):
            run.append(sample(mirror.token_ids + run))
            if j == k or run[-1] != mirror.drafts[j]:
                break
        mirror.token_ids += run
        if k:
            mirror.num_computed_tokens += len(run) - 1
        mirror.drafts = []
        return run

    def _propose(self, mirror: Mirror) -> int:
        room = len(self.kv) * self.block_size - len(mirror.token_ids)
        mirror.drafts = list(self.propose(mirror.token_ids))[:min(self.num_speculative_tokens, max(room, 0))]
        return len(mirror.drafts)

    def reset(self) -> None:
        self.mirrors.clear()
        for block in self.kv:
            block[:] = [LOST] * self.block_size


class FakeWorkerClient:
    """A worker rank over FakeWorker: steps take a moment and run in the order they were sent,
    as the gRPC worker runs them in step_id order. The steps named in die_at (counted over the
    client's whole life: step ids restart after a reset) fail as a crashing worker's do: it
    loses its state (and its lease) and refuses every step until it is reset. Steps and resets
    need the lease, as on the real worker; several engines may share one such client."""

    address = "fake"

    def __init__(self, die_at: set[int] = frozenset(), *, num_blocks: int = 12, block_size: int = 2,
                 vocab_size: int = 6, step_s: float = 0.002, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, poison: set[int] = frozenset(),
                 num_speculative_tokens: int = 0, propose: Callable[[list[int]], list[int]] | None = None) -> None:
        """`poison`: a step holding a request whose prompt starts with one of these tokens makes
        the worker crash, every time (a request that makes the worker fail)."""
        self.worker = FakeWorker(num_blocks, block_size, num_speculative_tokens, propose)
        self.max_num_seqs = max_num_seqs                       # what it reports taking in one step
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.die_at = die_at
        self.poison = poison
        self.dead = False
        self.restarts = 0
        self.num_steps = 0
        self._turn = asyncio.Lock()        # FIFO: the first step sent runs first
        self.num_in_flight = self.max_in_flight = 0
        # Steps that verify drafts in flight now, and steps sent while one was (scheduled ahead of it).
        self.verifying_in_flight = self.sent_behind_verification = 0
        self.lease = WorkerLease()

    async def claim(self, owner: str, epoch: int, lease_s: float, timeout: float) -> str:
        try:
            self.lease.claim(owner, epoch, lease_s)
        except LeaseError as e:
            raise WorkerError(f"worker {self.address}: FAILED_PRECONDITION: {e}") from e
        return str(self.restarts)

    async def prepare_grammar(self, constraint: Constraint, lease_epoch: int, timeout: float) -> None:
        """Grammars are not this fake's business: each compiles at once."""
        self._check_lease(lease_epoch, "prepare grammar")

    def _check_lease(self, epoch: int, what: str) -> None:
        try:
            self.lease.check(epoch, what)
        except LeaseError as e:
            raise WorkerError(f"worker {self.address}: FAILED_PRECONDITION: {e}") from e

    async def describe(self, timeout: float) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(max_model_len=len(self.worker.kv) * self.worker.block_size,
                                     block_size=self.worker.block_size, num_kv_blocks=len(self.worker.kv),
                                     instance_id=str(self.restarts), max_num_seqs=self.max_num_seqs,
                                     max_num_batched_tokens=self.max_num_batched_tokens,
                                     speculative_method="ngram" if self.worker.num_speculative_tokens else "",
                                     num_speculative_tokens=self.worker.num_speculative_tokens)

    async def step(self, request: worker_pb2.StepRequest, timeout: float) -> worker_pb2.StepResponse:
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        self.sent_behind_verification += self.verifying_in_flight > 0
        verifies = len(request.cached.draft_indices) > 0
        self.verifying_in_flight += verifies
        try:
            async with self._turn:
                await asyncio.sleep(self.step_s)     # the forward pass
                self.num_steps += 1
                if self.num_steps in self.die_at or self._poisoned(request):
                    self.dead = True
                    self.restarts += 1
                    self.worker.reset()
                    self.lease = WorkerLease()
                if self.dead:
                    raise WorkerError(f"worker died before step {request.step_id}")
                self._check_lease(request.lease_epoch, f"step {request.step_id}")
                sampled = self.worker.step(request, lambda tokens: prefix_token(tokens, self.vocab_size))
            return worker_pb2.StepResponse(step_id=request.step_id, token_ids=sampled,
                                           token_counts=self.worker.token_counts, num_drafts=self.worker.num_drafts,
                                           verified_drafts=self.worker.verified_drafts)
        finally:
            self.num_in_flight -= 1
            self.verifying_in_flight -= verifies

    def _poisoned(self, request: worker_pb2.StepRequest) -> bool:
        firsts = [new.token_ids[0] for new in request.new_requests]
        firsts += [self.worker.mirrors[s].token_ids[0] for s in request.cached.seq_ids if s in self.worker.mirrors]
        return any(first in self.poison for first in firsts)

    async def reset(self, lease_epoch: int, timeout: float) -> None:
        self._check_lease(lease_epoch, "reset")
        self.worker.reset()
        self.dead = False

    async def close(self) -> None:
        pass
