"""common/gc_freeze.py: once a process is ready, what it made at start-up is out of the
collector's way (a full collection walks only what was made since)."""
from __future__ import annotations

import gc

from common.gc_freeze import freeze_startup_heap


def test_every_object_alive_at_the_freeze_is_frozen_and_later_ones_are_not():
    kept = [[i] for i in range(1000)]       # lists: always tracked by the collector
    gc.unfreeze()
    try:
        frozen = freeze_startup_heap()
        # Other threads of the test process (xdist's channel) may free a frozen object at any time,
        # so the count only shrinks after the freeze; it is never below what this test keeps alive.
        assert frozen >= gc.get_freeze_count() >= len(kept)
        later = [[i] for i in range(10)]
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in kept)     # frozen objects are in no generation
        assert all(id(o) in tracked for o in later)
    finally:
        gc.unfreeze()
