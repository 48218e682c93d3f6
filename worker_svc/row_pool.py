"""Row indices of a per-request table, reused after release, so tables grow only when full."""
from __future__ import annotations


class RowPool:
    def __init__(self) -> None:
        self._free: list[int] = []
        self.high_water = 0   # rows ever handed out: the table needs at least this many

    def acquire(self) -> int:
        if self._free:
            return self._free.pop()
        self.high_water += 1
        return self.high_water - 1

    def release(self, row: int) -> None:
        self._free.append(row)


def grown_capacity(capacity: int, needed: int) -> int:
    """Doubles until `needed` rows fit, so growing costs amortised O(1) per row."""
    while capacity < needed:
        capacity *= 2
    return capacity
