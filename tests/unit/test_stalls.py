"""The stall judgement (casque.engine.stalls) and its report (casque.sidecar.stalls), as pure logic."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from casque.engine.stalls import RECEIVE_WAIT_SECONDS, ShardProgress, stall_threshold, zk_time
from casque.sidecar.stalls import StallReport
from casque.specs import SubscriberSpec

NOW = datetime(2026, 11, 27, 5, 0, tzinfo=timezone.utc)


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def test_the_threshold_follows_the_visibility_timeout_unless_stall_after_is_set() -> None:
    assert stall_threshold(SubscriberSpec(queue="q")) == 2 * 30 + RECEIVE_WAIT_SECONDS
    assert stall_threshold(SubscriberSpec(queue="q", visibility_timeout_seconds=300)) == 620.0
    assert stall_threshold(SubscriberSpec.model_validate({"queue": "q", "stallAfter": "5m"})) == 300.0
    # A failed message may wait out the retry policy's longest backoff before it comes back.
    assert stall_threshold(SubscriberSpec.model_validate({"queue": "q", "retry": {"maximumBackoff": "2m"}})) == 200.0
    assert stall_threshold(SubscriberSpec.model_validate(
        {"queue": "q", "retry": {"maximumBackoff": "2m"}, "stallAfter": 90})) == 90.0
    with pytest.raises(ValidationError):
        SubscriberSpec.model_validate({"queue": "q", "stallAfter": 0})
    with pytest.raises(ValidationError):
        SubscriberSpec.model_validate({"queue": "q", "stallAfter": "soon"})


def test_lag_with_an_offset_unmoved_past_the_threshold_is_a_stall() -> None:
    stuck = ShardProgress(shard=3, offset=10, head=12, offset_moved_at=ago(100), pending_since=ago(200))
    assert stuck.stalled_since(60, NOW) == ago(100)
    assert stuck.stalled_since(120, NOW) is None  # not yet


def test_no_lag_is_never_a_stall_however_old_the_offset() -> None:
    idle = ShardProgress(shard=0, offset=13, head=12, offset_moved_at=ago(86400), pending_since=None)
    assert idle.waiting_since is None and idle.stalled_since(1, NOW) is None


def test_a_message_published_after_an_idle_spell_starts_the_clock_afresh() -> None:
    # The offset was written an hour ago; the batch at it was published 5 s ago.
    woken = ShardProgress(shard=0, offset=13, head=13, offset_moved_at=ago(3600), pending_since=ago(5))
    assert woken.waiting_since == ago(5)
    assert woken.stalled_since(60, NOW) is None
    assert woken.stalled_since(5, NOW) == ago(5)


def test_an_old_backlog_with_a_moving_offset_is_no_stall() -> None:
    slow = ShardProgress(shard=0, offset=500, head=900, offset_moved_at=ago(2), pending_since=ago(3600))
    assert slow.waiting_since == ago(2) and slow.stalled_since(60, NOW) is None


def test_an_unreadable_pending_batch_falls_back_to_the_offset_time() -> None:
    unread = ShardProgress(shard=0, offset=5, head=9, offset_moved_at=ago(90), pending_since=None)
    assert unread.stalled_since(60, NOW) == ago(90)


def test_znode_times_are_utc() -> None:
    assert zk_time(1_764_219_600_000) == datetime(2025, 11, 27, 5, 0, tzinfo=timezone.utc)


def test_the_report_names_the_stalled_shards_and_their_time() -> None:
    assert StallReport(80.0).detail().startswith("none ")
    report = StallReport(2.0, {3: ago(10), 1: ago(4)}, 10.0)
    assert report.detail() == (
        "stalled: shard 1 since 2026-11-27T04:59:56+00:00, shard 3 since 2026-11-27T04:59:50+00:00 "
        "(lag and no offset move for 2s or more)")


def test_a_subscriber_without_stall_after_is_stored_as_the_previous_version_wrote_it() -> None:
    """Sidecars of the previous version refuse unknown spec fields: an unset stallAfter stays out of the znode."""
    from casque.engine.catalog import _subscriber_json
    from casque.specs import SubscriberState

    plain = SubscriberState(spec=SubscriberSpec(queue="q"), created_at=NOW, incarnation="i")
    assert b"stall_after_seconds" not in _subscriber_json(plain)
    assert SubscriberState.model_validate_json(_subscriber_json(plain)) == plain
    patient = SubscriberState(spec=SubscriberSpec(queue="q", stall_after_seconds=90), created_at=NOW)
    assert SubscriberState.model_validate_json(_subscriber_json(patient)) == patient
