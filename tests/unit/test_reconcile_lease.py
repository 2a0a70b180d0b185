"""Leader election on a Lease, against an in-memory Lease API with compare-and-set and a fake clock."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from casque.operator.leadership import Attempt, LeaderElector, LeaseConfig


class FakeLeases:
    """One namespace's Leases; replace() refuses a stale resourceVersion like the API server."""

    def __init__(self) -> None:
        self.leases: dict[str, client.V1Lease] = {}
        self.version = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ApiException(status=503, reason="Service Unavailable")

    def read_namespaced_lease(self, name: str, namespace: str) -> client.V1Lease:
        self._check()
        if name not in self.leases:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.leases[name])

    def create_namespaced_lease(self, namespace: str, body: client.V1Lease) -> client.V1Lease:
        self._check()
        if body.metadata.name in self.leases:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: client.V1Lease) -> client.V1Lease:
        self._check()
        if self.leases[name].metadata.resource_version != body.metadata.resource_version:
            raise ApiException(status=409, reason="Conflict")
        return self._store(body)

    def _store(self, body: client.V1Lease) -> client.V1Lease:
        self.version += 1
        stored = copy.deepcopy(body)
        stored.metadata.resource_version = str(self.version)
        self.leases[stored.metadata.name] = stored
        return stored

    def holder(self) -> Any:
        return self.leases["casque-operator"].spec.holder_identity


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(api: FakeLeases, clock: Clock, identity: str) -> LeaderElector:
    config = LeaseConfig(name="casque-operator", namespace="casque", identity=identity)
    return LeaderElector(api, config, clock=clock)  # type: ignore[arg-type]


def test_one_leader_and_a_takeover_after_expiry() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert a.attempt() is Attempt.LEADING and api.holder() == "a"
    assert b.attempt() is Attempt.FOLLOWING
    clock.now += 5
    assert a.attempt() is Attempt.LEADING  # renewal
    clock.now += 10
    assert b.attempt() is Attempt.FOLLOWING  # renewed 10 s ago, by b's own observation
    # a stops renewing; b takes over once it has seen the record unchanged for the duration.
    clock.now += 14
    assert b.attempt() is Attempt.FOLLOWING
    clock.now += 2
    assert b.attempt() is Attempt.LEADING and api.holder() == "b"
    assert api.leases["casque-operator"].spec.lease_transitions == 1
    assert a.attempt() is Attempt.FOLLOWING


def test_expiry_is_judged_by_observation_not_by_the_holders_clock() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    assert a.attempt() is Attempt.LEADING
    # The record says renewTime long ago (a's wall clock is off), but b has only just seen it.
    api.leases["casque-operator"].spec.renew_time = api.leases["casque-operator"].spec.renew_time.replace(year=2000)
    b = elector(api, clock, "b")
    assert b.attempt() is Attempt.FOLLOWING


def test_a_leader_that_cannot_renew_stops_leading_before_the_lease_expires() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    assert a.attempt() is Attempt.LEADING and a.leading
    api.down = True
    clock.now += 9
    assert a.attempt() is Attempt.FAILED and a.leading  # within renew_deadline
    clock.now += 2
    assert a.attempt() is Attempt.FAILED and not a.leading  # past it: 11 s < 15 s duration


def test_racing_candidates_cannot_both_win() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert a.attempt() is Attempt.LEADING
    a.release()
    assert api.holder() is None
    # Both read the released Lease, then both write: the second write is refused.
    lease_seen_by_b = api.read_namespaced_lease("casque-operator", "casque")
    assert a.attempt() is Attempt.LEADING
    lease_seen_by_b.spec.holder_identity = "b"
    with pytest.raises(ApiException) as conflict:
        api.replace_namespaced_lease("casque-operator", "casque", lease_seen_by_b)
    assert conflict.value.status == 409
    assert b.attempt() is Attempt.FOLLOWING


def test_a_released_lease_is_taken_at_once() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert a.attempt() is Attempt.LEADING
    a.release()
    assert b.attempt() is Attempt.LEADING and api.holder() == "b"


def test_timings_must_nest() -> None:
    with pytest.raises(ValueError):
        LeaseConfig(name="l", namespace="n", identity="i", duration=10, renew_deadline=10)
