"""A namespace's stored-bytes quota: the verdict, when the role's writes change, the grants."""

from __future__ import annotations

from typing import Any

import pytest

from casque.backends import disk_usage
from casque.backends.disk_usage import MEBIBYTE, StoredBytes
from casque.engine import catalog
from casque.errors import InvalidSpec
from casque.operator.quotas import MAX_STORED_BYTES, QuotaSettings, limits_for
from casque.operator.storage_quota import NamespaceStorage, StorageVerdict
from casque.schema import CONSUMING_TABLES, namespace_writes_cql
from casque.tenancy import NamespaceRole

ROLE = NamespaceRole("i1_team_a", "i1_team_a", "secret")


def test_a_namespace_publishes_up_to_its_limit_and_not_past_it() -> None:
    assert StorageVerdict(StoredBytes(5 * MEBIBYTE, 1), limit=None).publishing
    assert StorageVerdict(StoredBytes(5 * MEBIBYTE, 1), limit=5 * MEBIBYTE).publishing
    over = StorageVerdict(StoredBytes(6 * MEBIBYTE, 3, ("10.0.0.3:9042",)), limit=5 * MEBIBYTE)
    assert not over.publishing
    assert "over its limit of 5 MiB" in over.describe() and "10.0.0.3:9042" in over.describe()


def test_the_narrow_writes_name_the_consuming_tables_and_grant_before_they_revoke() -> None:
    narrow = namespace_writes_cql("r", "ks", publishing=False)
    assert narrow[-1] == 'REVOKE MODIFY ON KEYSPACE ks FROM "r"'
    assert narrow[:-1] == [f'GRANT MODIFY ON TABLE ks.{table} TO "r"' for table in CONSUMING_TABLES]
    wide = namespace_writes_cql("r", "ks", publishing=True)
    assert wide[0] == 'GRANT MODIFY ON KEYSPACE ks TO "r"'
    assert all(statement.startswith("REVOKE MODIFY ON TABLE") for statement in wide[1:])


def test_the_roles_writes_change_only_when_the_verdict_does(monkeypatch: pytest.MonkeyPatch) -> None:
    given: list[bool] = []
    monkeypatch.setattr(catalog, "set_namespace_publishing", lambda store, role, publishing: given.append(publishing))
    storage = NamespaceStorage(interval_seconds=60)
    within = StorageVerdict(StoredBytes(MEBIBYTE, 1), limit=2 * MEBIBYTE)
    over = StorageVerdict(StoredBytes(3 * MEBIBYTE, 1), limit=2 * MEBIBYTE)
    store: Any = object()
    # The first verdict is applied (another replica may have left the writes either way),
    # and is no change of its own.
    assert storage.enforce(store, ROLE, "team-a", within) is False
    assert storage.enforce(store, ROLE, "team-a", within) is False
    assert storage.enforce(store, ROLE, "team-a", over) is True
    assert storage.enforce(store, ROLE, "team-a", over) is False
    assert storage.enforce(store, ROLE, "team-a", within) is True
    assert given == [True, False, True]
    storage.granted("team-b", False)
    assert storage.enforce(store, ROLE, "team-b", over) is False
    assert given == [True, False, True]


def test_a_namespace_is_measured_again_after_the_interval_or_when_its_limit_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[str] = []

    def measure(session: Any, keyspace: str) -> StoredBytes:
        measured.append(keyspace)
        return StoredBytes(4 * MEBIBYTE, 1)

    monkeypatch.setattr(disk_usage, "keyspace_bytes", measure)
    store: Any = type("FakeStore", (), {"session": None})()
    storage = NamespaceStorage(interval_seconds=3600)
    assert storage.publishing("team-a")  # never measured: not held back
    assert not storage.verdict(store, ROLE, "team-a", 2 * MEBIBYTE).publishing
    assert not storage.verdict(store, ROLE, "team-a", 2 * MEBIBYTE).publishing
    assert measured == [ROLE.keyspace]
    assert storage.verdict(store, ROLE, "team-a", None).publishing
    assert len(measured) == 2
    assert storage.publishing("team-a")
    storage.forget("team-a")
    storage.verdict(store, ROLE, "team-a", None)
    assert len(measured) == 3


def test_the_stored_bytes_limit_comes_from_the_annotation_or_the_default() -> None:
    defaults = QuotaSettings(max_stored_bytes=8 * 1024 * MEBIBYTE)
    assert limits_for(defaults, None).max_stored_bytes == 8 * 1024 * MEBIBYTE
    assert limits_for(defaults, {MAX_STORED_BYTES: "1048576"}).max_stored_bytes == MEBIBYTE
    assert limits_for(defaults, {MAX_STORED_BYTES: ""}).max_stored_bytes is None
    for bad in ("0", "lots", "-1"):
        with pytest.raises(InvalidSpec, match="max-stored-bytes"):
            limits_for(defaults, {MAX_STORED_BYTES: bad})
