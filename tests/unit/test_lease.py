"""The worker's lease (worker_svc/lease.py) on a clock the test moves: one scheduler at a time,
taken over only once the owner has been silent for the lease's duration, re-claimed at once by
the same identity, and every other epoch's step refused."""
from __future__ import annotations

import pytest

from worker_svc.lease import LeaseHeld, StaleLease, WorkerLease


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def lease(clock) -> WorkerLease:
    return WorkerLease(clock)


def test_an_unclaimed_worker_refuses_steps(lease):
    with pytest.raises(StaleLease, match="not leased to any scheduler yet; Claim it first"):
        lease.check(0, "step 1")


def test_a_second_scheduler_is_refused_naming_the_owner_while_the_lease_lives(lease, clock):
    lease.claim("sched-a", 7, 10.0)
    lease.check(7, "step 1")
    clock.now += 9.0
    with pytest.raises(LeaseHeld, match="leased to scheduler 'sched-a', whose steps renew it") as held:
        lease.claim("sched-b", 8, 10.0)
    assert "7" not in str(held.value), "the refusal told the held epoch"
    # Steps renew it: 9 s after the last one it is still alive, 19 s after the claim.
    lease.check(7, "step 2")
    clock.now += 9.0
    with pytest.raises(LeaseHeld):
        lease.claim("sched-b", 8, 10.0)
    assert lease.lease.owner == "sched-a"


def test_a_renewal_keeps_an_idle_owner_s_lease(lease, clock):
    lease.claim("sched-a", 7, 10.0)
    for _ in range(5):
        clock.now += 8.0
        lease.claim("sched-a", 7, 10.0)       # the idle probe
    with pytest.raises(LeaseHeld):
        lease.claim("sched-b", 8, 10.0)


def test_once_the_owner_is_silent_for_the_lease_another_takes_over_and_fences_it_off(lease, clock):
    lease.claim("sched-a", 7, 10.0)
    clock.now += 10.0
    lease.claim("sched-b", 8, 10.0)
    with pytest.raises(StaleLease, match="carries lease epoch 7, which is not the epoch of the lease held by "
                                         "scheduler 'sched-b'") as stale:
        lease.check(7, "step 3")
    assert "8" not in str(stale.value), "the refusal told the held epoch"
    with pytest.raises(LeaseHeld, match="'sched-b'"):
        lease.claim("sched-a", 9, 10.0)
    lease.check(8, "step 1")


def test_a_restarted_scheduler_reclaims_at_once_and_its_old_epoch_is_refused(lease):
    lease.claim("sched-a", 7, 10.0)
    lease.claim("sched-a", 12, 10.0)          # same identity, fresh epoch: no wait
    assert (lease.lease.owner, lease.lease.epoch) == ("sched-a", 12)
    with pytest.raises(StaleLease):
        lease.check(7, "step 40")
    lease.check(12, "reset")


def test_a_lapsed_lease_nobody_took_still_serves_its_owner(lease, clock):
    lease.claim("sched-a", 7, 1.0)
    clock.now += 60.0
    lease.check(7, "step 9")                  # nobody else touched the worker meanwhile
    with pytest.raises(LeaseHeld):            # and the step renewed it
        lease.claim("sched-b", 8, 1.0)


def test_a_finished_step_renews_only_its_own_epoch(lease, clock):
    lease.claim("sched-a", 7, 10.0)
    clock.now += 9.0
    lease.touch(7)                            # a long step ends: 10 s more from now
    clock.now += 9.0
    with pytest.raises(LeaseHeld):
        lease.claim("sched-b", 8, 10.0)
    clock.now += 10.0
    lease.claim("sched-b", 8, 10.0)
    lease.touch(7)                            # sched-a's late step changes nothing
    assert lease.lease.owner == "sched-b"


@pytest.mark.parametrize("owner, epoch, duration, message", [
    ("", 1, 1.0, "identity"), ("a", 0, 1.0, "positive epoch"), ("a", 1, 0.0, "positive duration")])
def test_malformed_claims_are_refused(lease, owner, epoch, duration, message):
    with pytest.raises(ValueError, match=message):
        lease.claim(owner, epoch, duration)
