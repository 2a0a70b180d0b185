"""The liveness logic: a watch that lags a LIST for too long, without moving, is stalled."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from casque.config import Settings
from casque.operator.context import OperatorContext, StoreHolder
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


async def test_the_probe_fails_on_a_stall_and_not_on_an_api_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    from casque.operator.handlers import probes

    context = OperatorContext(stores=StoreHolder(Settings()), health=WatchHealth(stall_after=0.0))
    listed: dict[str, dict[str, str]] = {"queues": {"a": "11"}, "subscribers": {}}

    def list_versions(_: OperatorContext, plural: str) -> dict[str, str]:
        if plural not in listed:
            raise ConnectionError("API server down")
        return listed[plural]

    monkeypatch.setattr(probes, "list_versions", list_versions)
    seen: dict[str, Any] = {"queues": {"a": ["10"]}, "subscribers": {}}
    report = await probes.watch_health(context, seen)  # first noticed: not yet a stall
    assert report["queues"] == {"listed": 1, "watched": 1, "stalled": 0}
    with pytest.raises(kopf.PermanentError, match="watch stream stalled: .*queues/a"):
        await probes.watch_health(context, seen)

    del listed["queues"]  # an API outage says nothing about the watch
    assert (await probes.watch_health(context, seen))["queues"] == {"listed": None}
