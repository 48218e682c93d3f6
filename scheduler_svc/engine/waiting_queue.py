"""The scheduler's waiting requests, in the order they are admitted: by priority (lower first, as
vLLM), then by arrival.

A preempted request goes back by the same key, so among equal priorities it is ahead of every
request that arrived after it: with one priority this is the FCFS queue with preempted requests at
its head. Requests of one priority arrive in key order, so the common insertion is an append.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator

from scheduler_svc.engine.sequence import Sequence


def admission_key(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival_order


class WaitingQueue:
    def __init__(self) -> None:
        self._seqs: list[Sequence] = []

    def push(self, seq: Sequence) -> None:
        seqs = self._seqs
        if not seqs or admission_key(seqs[-1]) <= admission_key(seq):
            seqs.append(seq)
        else:
            bisect.insort_right(seqs, seq, key=admission_key)

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
