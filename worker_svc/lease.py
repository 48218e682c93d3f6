"""Which scheduler owns this worker: a lease, so that two schedulers pointed at one worker never
interleave their steps (each would drop the other's request mirrors or, worse, compute into block
ids the other one handed out, silently swapping tokens between their requests).

A scheduler claims the worker under its identity (stable across its restarts) and an epoch it
picks afresh for every claim. Every step and reset must carry the epoch of the live lease; each
one renews it, and an idle scheduler renews it by claiming again with the epoch it holds. While
the lease lives, a claim under another identity is refused, naming the owner. Once the owner has
been silent for the lease's duration, anyone may claim it; a restarted owner (same identity, new
epoch) claims at once, and the epoch change fences off whatever its previous life still sends.

A lapsed lease that nobody else claimed is still honoured: its owner's steps renew it, since no
one else can have touched the worker meanwhile.

A lease lasts at most `max_duration_s` (the worker's --max-lease): a longer claim is granted that
long, so nobody who reaches the port once an owner falls silent can keep every scheduler out for
longer than that without renewing.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)


class LeaseError(Exception):
    """A claim, step or reset the lease refuses; str() names the owner."""


class LeaseHeld(LeaseError):
    """Another scheduler holds a live lease."""


class StaleLease(LeaseError):
    """A step or reset carries an epoch other than the live lease's: its sender lost the worker
    (or never claimed it)."""


@dataclass(frozen=True, slots=True)
class Lease:
    owner: str
    epoch: int
    duration_s: float


# The longest lease a claim is granted: the scheduler's own (--worker-lease, 10 s) and a few
# seconds of its renewals' slack (an idle scheduler renews every second, a busy one every step).
DEFAULT_MAX_DURATION_S = 15.0


class WorkerLease:
    """Thread-safe: the gRPC server calls it from several threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_duration_s: float = DEFAULT_MAX_DURATION_S) -> None:
        if not max_duration_s > 0:
            raise ValueError(f"a lease's upper bound must be positive, got {max_duration_s} s")
        self._clock = clock
        self.max_duration_s = max_duration_s
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._expires_at = 0.0

    @property
    def lease(self) -> Lease | None:
        return self._lease

    def claim(self, owner: str, epoch: int, duration_s: float) -> float:
        """Takes the lease for (owner, epoch), or renews it when that is the lease held; returns
        the duration granted (at most max_duration_s). Raises ValueError for a malformed claim and
        LeaseHeld while another owner's lease lives."""
        if not owner:
            raise ValueError("a claim needs the scheduler's identity (owner)")
        if epoch <= 0:
            raise ValueError(f"a claim needs a positive epoch, got {epoch}")
        if not duration_s > 0:
            raise ValueError(f"a lease needs a positive duration, got {duration_s} s")
        duration_s = min(duration_s, self.max_duration_s)
        with self._lock:
            now = self._clock()
            held = self._lease
            if held is not None and held.owner != owner and now < self._expires_at:
                # The held epoch is never told: a step carrying it would pass check().
                raise LeaseHeld(f"the worker is leased to scheduler {held.owner!r}, whose "
                                f"steps renew it; it can be claimed once {held.owner!r} has been silent for "
                                f"{held.duration_s:g} s")
            self._lease = Lease(owner, epoch, duration_s)
            self._expires_at = now + duration_s
        if held is None or (held.owner, held.epoch) != (owner, epoch):
            self._log_change(held, self._lease)
        return duration_s

    def check(self, epoch: int, what: str) -> None:
        """Lets a step or reset of the lease's epoch through, renewing the lease; raises
        StaleLease otherwise. `what` names the call in the message ("step 12")."""
        with self._lock:
            held = self._lease
            if held is None:
                raise StaleLease(f"{what} refused: the worker is not leased to any scheduler yet; Claim it first")
            if epoch != held.epoch:
                raise StaleLease(f"{what} refused: it carries lease epoch {epoch}, which is not the epoch of the "
                                 f"lease held by scheduler {held.owner!r}")
            self._expires_at = self._clock() + held.duration_s

    def touch(self, epoch: int) -> None:
        """Renews the lease if `epoch` is still its epoch (a step that just finished: a long one
        must not let its own lease lapse)."""
        with self._lock:
            if self._lease is not None and self._lease.epoch == epoch:
                self._expires_at = self._clock() + self._lease.duration_s

    @staticmethod
    def _log_change(old: Lease | None, new: Lease) -> None:
        if old is None:
            logger.info("leased to scheduler %r (epoch %d, %g s)", new.owner, new.epoch, new.duration_s)
        elif old.owner == new.owner:
            # Normal after the scheduler restarted; repeated, it means two schedulers share one identity.
            logger.warning("scheduler %r claimed the worker again (epoch %d -> %d): steps of the old epoch are "
                           "refused from now on", new.owner, old.epoch, new.epoch)
        else:   # another owner's lease can only be taken once it lapsed
            logger.warning("scheduler %r took the worker over (epoch %d): the lease of %r (epoch %d) had lapsed",
                           new.owner, new.epoch, old.owner, old.epoch)
