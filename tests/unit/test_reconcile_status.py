"""Conditions and status patches: a reconcile that finds everything in place writes nothing."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from casque.operator import conditions

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
T1 = T0 + timedelta(minutes=5)


def test_transition_time_moves_only_when_the_status_flips() -> None:
    first = conditions.with_condition(None, "Ready", status=False, reason="BackendUnavailable", message="down", generation=1, now=T0)
    assert first == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "BackendUnavailable",
            "message": "down",
            "lastTransitionTime": "2026-03-01T12:00:00Z",
            "observedGeneration": 1,
        }
    ]
    same = conditions.with_condition(first, "Ready", status=False, reason="QueueNotFound", message="no queue", generation=2, now=T1)
    assert same[0]["lastTransitionTime"] == "2026-03-01T12:00:00Z"
    assert (same[0]["reason"], same[0]["observedGeneration"]) == ("QueueNotFound", 2)
    flipped = conditions.with_condition(same, "Ready", status=True, reason="Reconciled", message="ok", generation=2, now=T1)
    assert flipped[0]["lastTransitionTime"] == "2026-03-01T12:05:00Z"


def test_other_conditions_are_kept() -> None:
    others = [{"type": "Available", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    result = conditions.with_condition(others, "Ready", status=True, reason="R", message="m", generation=None, now=T0)
    assert [c["type"] for c in result] == ["Available", "Ready"]
    assert "observedGeneration" not in result[1]


def test_merge_patch_holds_only_differences() -> None:
    current = {"shards": 4, "lagBatches": 0, "warnings": ["many tables"], "oldestPendingTime": "2026-03-01T11:00:00Z"}
    wanted = {"shards": 4, "lagBatches": 7, "oldestPendingTime": None, "depth": None}
    assert conditions.merge_patch(current, wanted) == {"lagBatches": 7, "oldestPendingTime": None}
    assert conditions.merge_patch(current, {"shards": 4}) == {}
    assert conditions.merge_patch(None, {"shards": 4}) == {"shards": 4}


def test_timestamps_are_utc_seconds() -> None:
    local = datetime(2026, 3, 1, 14, 0, 30, 999999, tzinfo=timezone(timedelta(hours=2)))
    assert conditions.timestamp(local) == "2026-03-01T12:00:30Z"
