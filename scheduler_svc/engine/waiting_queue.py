"""The scheduler's waiting requests, in the order they are admitted: by priority (lower first, as
vLLM), aged by the time they have waited, then by arrival.

Aging: each priority level is worth `aging_s` seconds of waiting, so a request's key is its
arrival time plus priority * aging_s. A request is served before every request that arrives more
than (its priority - theirs) * aging_s seconds after it, whatever their priority: with priorities
bounded to -N..N, no request waits behind later arrivals for more than 2 * N * aging_s seconds.
The key never changes, so the queue stays sorted; with aging_s 0 the order is strict priority.

A preempted request goes back by the same key, so among equal priorities it is ahead of every
request that arrived after it: with one priority this is the FCFS queue with preempted requests at
its head. Requests of one priority arrive in key order, so the common insertion is an append.
"""
from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator

from scheduler_svc.engine.sequence import Sequence


def admission_key(seq: Sequence, aging_s: float = 0.0) -> tuple[float, int, int]:
    """Lower first: the aged priority, then (without aging) the priority, then arrival."""
    if aging_s:
        return seq.arrival_time + seq.priority * aging_s, 0, seq.arrival_order
    return 0.0, seq.priority, seq.arrival_order


class WaitingQueue:
    def __init__(self, aging_s: float = 0.0) -> None:
        self._seqs: list[Sequence] = []
        self.key = functools.partial(admission_key, aging_s=aging_s)

    def push(self, seq: Sequence) -> None:
        seqs, key = self._seqs, self.key
        if not seqs or key(seqs[-1]) <= key(seq):
            seqs.append(seq)
        else:
            bisect.insort_right(seqs, seq, key=key)

    def head(self) -> Sequence:
        return self._seqs[0]

    def pop_head(self) -> Sequence:
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def clear(self) -> None:
        self._seqs.clear()

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)
