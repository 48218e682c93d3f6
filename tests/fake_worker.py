"""A model of the worker for scheduler tests: it follows the step messages as the real one does
(request mirrors, appended samples) and keeps a model KV cache in which every slot records the
token prefix that produced it, so wrong KV (a stale prefix-cache hit, a shared block overwritten,
a mirror out of step with the scheduler) shows up as a wrong slot."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from common.pb.llm.worker.v1 import worker_pb2
from scheduler_svc.block_manager import hash_block

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

    def step(self, request: worker_pb2.StepRequest, sample: Callable[[list[int]], int]) -> list[int]:
        """Runs a step as the real worker does; sample(tokens) picks the next token. Returns one
        token per request that samples, in batch order (cached requests, then new ones)."""
        for seq_id in request.finished_seq_ids:
            del self.mirrors[seq_id]
        cached = request.cached
        counts = dict(zip(cached.multi_token_indices, cached.multi_token_counts))
        new_blocks, offset = {}, 0
        for index, count in zip(cached.new_block_indices, cached.new_block_counts):
            new_blocks[index] = list(cached.new_block_ids[offset:offset + count])
            offset += count
        scheduled = []
        for i, seq_id in enumerate(cached.seq_ids):
            self.mirrors[seq_id].block_ids.extend(new_blocks.get(i, []))
            scheduled.append((seq_id, counts.get(i, 1)))
        for new in request.new_requests:
            assert new.seq_id not in self.mirrors
            mirror = Mirror(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.assert_kv(mirror)                       # the prefix-cache hit it relies on
            self.mirrors[new.seq_id] = mirror
            scheduled.append((new.seq_id, new.num_scheduled_tokens))
        for seq_id, n in scheduled:                      # write every slot, then read
            mirror = self.mirrors[seq_id]
            start = mirror.num_computed_tokens
            assert n >= 1 and start + n <= len(mirror.token_ids)
            assert start + n <= len(mirror.block_ids) * self.block_size
            for p in range(start, start + n):
                self.kv[mirror.block_ids[p // self.block_size]][p % self.block_size] = \
                    tuple(mirror.token_ids[:p + 1])
            mirror.num_computed_tokens += n
        sampled = []
        for seq_id, _ in scheduled:
            mirror = self.mirrors[seq_id]
            self.assert_kv(mirror)
            if mirror.num_computed_tokens == len(mirror.token_ids):
                sampled.append(sample(mirror.token_ids))
                mirror.token_ids.append(sampled[-1])
        return sampled

    def reset(self) -> None:
        self.mirrors.clear()
        for block in self.kv:
            block[:] = [LOST] * self.block_size
