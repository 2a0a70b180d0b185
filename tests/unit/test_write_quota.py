"""A namespace's write-rate quota: the allowance over successive measures, and the verdict."""

from __future__ import annotations

from typing import Any

import pytest

from casque.backends import disk_usage, write_counts
from casque.backends.disk_usage import MEBIBYTE, StoredBytes
from casque.backends.write_counts import CoordinatedWrites
from casque.errors import InvalidSpec
from casque.operator.quotas import MAX_WRITES_PER_SECOND, QuotaSettings, limits_for
from casque.operator.storage_quota import NamespaceStorage, StorageVerdict
from casque.operator.write_quota import BURST_SECONDS, RateVerdict, WriteAllowance, writes_between
from casque.schema import ACKS_TABLE, CONSUMING_TABLES
from casque.tenancy import NamespaceRole

ROLE = NamespaceRole("i1_team_a", "i1_team_a", "secret")


def test_writes_are_counted_per_node_through_a_restart_and_from_a_new_node_on() -> None:
    assert writes_between({"a": 100, "b": 50}, {"a": 130, "b": 60}) == 40
    # b restarted and counts from zero again; c is new: its writes so far are not this interval's.
    assert writes_between({"a": 100, "b": 50}, {"a": 100, "b": 7, "c": 900}) == 7


def test_a_burst_past_the_limit_is_refused_until_the_allowance_refills() -> None:
    allowance = WriteAllowance(limit=10.0)
    first = allowance.measure(0.0, {"a": 1_000})
    assert first.within and first.writes_per_second is None  # a baseline, nothing to compare
    # Within its rate: 10/s for 30 s.
    assert allowance.measure(30.0, {"a": 1_300}).within
    # Ten times its rate for 30 s: the saved minute and the interval's share do not cover it.
    burst = allowance.measure(60.0, {"a": 4_300})
    assert not burst.within and burst.writes_per_second == pytest.approx(100.0)
    assert "over its limit of 10 writes/s" in burst.describe()
    # Writing nothing while refused, it refills at 10/s: 2,400 short after the burst, so 240 s.
    assert not allowance.measure(60.0 + 180.0, {"a": 4_300}).within
    assert allowance.measure(60.0 + 240.0, {"a": 4_300}).within
    # Never more saved than a burst of BURST_SECONDS at the limit.
    idle = allowance.measure(10_000.0, {"a": 4_300})
    assert idle.allowance == pytest.approx(10.0 * BURST_SECONDS)


def test_a_namespace_publishes_only_within_both_its_stored_bytes_and_its_rate() -> None:
    stored = StoredBytes(MEBIBYTE, 1)
    within = RateVerdict(5.0, 10.0, allowance=100.0)
    spent = RateVerdict(50.0, 10.0, allowance=-20.0)
    assert StorageVerdict(stored, None, within).reason == "WithinQuota"
    verdict = StorageVerdict(stored, None, spent)
    assert not verdict.publishing and verdict.reason == "WriteRateQuotaExceeded"
    assert "50.0 writes/s, over its limit of 10 writes/s" in verdict.describe()
    too_big = StorageVerdict(StoredBytes(3 * MEBIBYTE, 1), 2 * MEBIBYTE, spent)
    assert too_big.reason == "StoredBytesQuotaExceeded"


def test_the_operator_counts_the_publishing_tables_and_starts_again_when_the_limit_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = iter([10, 10_000, 10_000])
    asked: list[bool] = []

    def writes(session: Any, keyspace: str, counted: Any) -> CoordinatedWrites:
        asked.append(counted(ACKS_TABLE) or any(counted(t) for t in CONSUMING_TABLES))
        assert counted("m_orders_0123456789")
        return CoordinatedWrites({"node": next(counts)})

    monkeypatch.setattr(disk_usage, "keyspace_bytes", lambda session, keyspace: StoredBytes(0, 1))
    monkeypatch.setattr(write_counts, "keyspace_writes", writes)
    store: Any = type("FakeStore", (), {"session": None})()
    storage = NamespaceStorage(interval_seconds=0)
    assert storage.verdict(store, ROLE, "team-a", None, rate_limit=1).publishing
    assert not storage.verdict(store, ROLE, "team-a", None, rate_limit=1).publishing
    # A new limit starts a new allowance from the next reading.
    assert storage.verdict(store, ROLE, "team-a", None, rate_limit=2).publishing
    assert asked == [False, False, False]  # consumers' tables never counted
    assert storage.verdict(store, ROLE, "team-a", None).rate is None


def test_the_write_rate_limit_comes_from_the_annotation_or_the_default() -> None:
    defaults = QuotaSettings(max_writes_per_second=500)
    assert limits_for(defaults, None).max_writes_per_second == 500
    assert limits_for(defaults, {MAX_WRITES_PER_SECOND: "20"}).max_writes_per_second == 20
    assert limits_for(defaults, {MAX_WRITES_PER_SECOND: ""}).max_writes_per_second is None
    for bad in ("0", "fast"):
        with pytest.raises(InvalidSpec, match="max-writes-per-second"):
            limits_for(defaults, {MAX_WRITES_PER_SECOND: bad})
