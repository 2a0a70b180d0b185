"""A queue's grant as a pure rule: what of a spec lies beyond it (casque.engine.grants)."""

from __future__ import annotations

from casque.engine.grants import QueueGrant, excess
from casque.specs import QueueSpec


def test_a_spec_within_its_grant_has_no_excess_and_one_beyond_says_what() -> None:
    approved = QueueSpec(shards=2, priorities=1, retention_seconds=3600)
    grant = QueueGrant.of(approved)
    assert excess(approved, grant) == []
    assert excess(QueueSpec(shards=1, retention_seconds=60), grant) == []  # less is never refused
    assert excess(QueueSpec(shards=256, priorities=10, retention_seconds=7200), grant) == [
        "256 shards (granted 2)", "10 priority levels (granted 1)", "retention 7200s (granted 3600s)"]


def test_while_a_spec_changes_the_grant_covers_the_old_and_the_new_one() -> None:
    old = QueueGrant(shards=4, priorities=1, retention_seconds=7200)
    new = QueueGrant(shards=6, priorities=2, retention_seconds=3600)
    assert old.widest(new) == QueueGrant(shards=6, priorities=2, retention_seconds=7200)
