"""The liveness logic: a watch that lags a LIST for too long, without moving, is stalled."""

from __future__ import annotations

from casque.operator.health import WatchHealth


def test_in_step_is_healthy() -> None:
    health = WatchHealth(stall_after=60)
    assert health.check("queues", {"a": "10", "b": "12"}, {"a": "10", "b": "12"}, now=0) == []


def test_a_gap_that_persists_is_a_stall() -> None:
    health = WatchHealth(stall_after=60)
    assert health.check("queues", {"a": "10"}, {"a": "11"}, now=0) == []  # a LIST may overtake the watch
    assert health.check("queues", {"a": "10"}, {"a": "11"}, now=59) == []
    assert health.check("queues", {"a": "10"}, {"a": "12"}, now=61) == ["a"]


def test_a_moving_watch_is_alive_even_when_behind() -> None:
    health = WatchHealth(stall_after=60)
    health.check("queues", {"a": "10"}, {"a": "11"}, now=0)
    assert health.check("queues", {"a": "11"}, {"a": "12"}, now=61) == []  # it delivered 11 meanwhile
    assert health.check("queues", {"a": "11"}, {"a": "12"}, now=100) == []
    assert health.check("queues", {"a": "11"}, {"a": "13"}, now=122) == ["a"]


def test_objects_never_delivered_count_and_caught_up_ones_are_forgotten() -> None:
    health = WatchHealth(stall_after=60)
    health.check("queues", {}, {"new": "5"}, now=0)
    assert health.check("queues", {}, {"new": "5"}, now=60) == ["new"]
    assert health.check("queues", {"new": "5"}, {"new": "5"}, now=61) == []
    health.check("queues", {}, {"gone": "7"}, now=100)
    assert health.check("queues", {}, {}, now=200) == []  # deleted meanwhile


def test_kinds_are_separate() -> None:
    health = WatchHealth(stall_after=60)
    health.check("queues", {}, {"x": "1"}, now=0)
    assert health.check("subscribers", {}, {}, now=100) == []
    assert health.check("queues", {}, {"x": "1"}, now=100) == ["x"]
