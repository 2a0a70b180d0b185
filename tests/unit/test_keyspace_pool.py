"""The test suite's keyspace pool (tests/fixtures/keyspaces.py) drops the tables tests added,
and the keyspaces it drops whole, in batches, back to back, and hands out only keyspaces as
fresh as new ones."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures import keyspaces
from tests.fixtures.keyspaces import RETIRED_BATCH, KeyspacePool, KeyspaceShape

FRESH = KeyspaceShape(replication="rf1", tables={"catalog": ("c",), "acks": ("a",)}, other_objects=0)


class RecordingSession:
    """Records the statements; the keyspaces' shapes come from `shapes` (see the fixture)."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def execute(self, query: str, *_: Any, **__: Any) -> list[Any]:
        self.statements.append(query)
        return []


@pytest.fixture
def shapes(monkeypatch: pytest.MonkeyPatch) -> dict[str, KeyspaceShape]:
    """The shape of each keyspace by name, as the pool reads it (fresh unless set)."""
    known: dict[str, KeyspaceShape] = {}
    monkeypatch.setattr(KeyspaceShape, "read", classmethod(lambda cls, session, name: known.get(name, FRESH)))
    monkeypatch.setattr(keyspaces, "ensure_keyspace", lambda session, name, replication: None)
    return known


def with_queue_table(table: str) -> KeyspaceShape:
    return KeyspaceShape(FRESH.replication, {**FRESH.tables, table: ("m",)}, 0)


def never_dropped(session: Any, name: str) -> None:
    raise AssertionError(f"keyspace {name} dropped")


def test_added_tables_are_dropped_back_to_back_once_a_batch_of_keyspaces_waits(
        shapes: dict[str, KeyspaceShape]) -> None:
    session = RecordingSession()
    pool = KeyspacePool(session, "rf1")  # type: ignore[arg-type]
    taken = [pool.take(never_dropped) for _ in range(RETIRED_BATCH)]
    for name in taken[:-1]:
        shapes[name] = with_queue_table(f"m_{name}")
        pool.give_back(name, never_dropped)
    assert not [s for s in session.statements if s.startswith("DROP")]

    session.statements.clear()
    shapes[taken[-1]] = with_queue_table(f"m_{taken[-1]}")
    pool.give_back(taken[-1], never_dropped)
    assert session.statements == [f"DROP TABLE IF EXISTS {name}.m_{name}" for name in taken]

    session.statements.clear()
    for name in taken:
        shapes[name] = FRESH  # as the drops leave them
    again = pool.take(never_dropped)
    assert again in taken
    assert sorted(session.statements) == [f"TRUNCATE {again}.acks", f"TRUNCATE {again}.catalog"]


def test_keyspaces_dropped_whole_wait_for_a_batch_beside_the_added_tables(
        shapes: dict[str, KeyspaceShape]) -> None:
    session = RecordingSession()
    pool = KeyspacePool(session, "rf1")  # type: ignore[arg-type]
    dropped: list[str] = []

    def drop(_: Any, keyspace: str) -> None:
        session.statements.append(f"DROP KEYSPACE {keyspace}")
        dropped.append(keyspace)

    pooled = pool.take(never_dropped)
    shapes[pooled] = with_queue_table("m_queue")
    pool.give_back(pooled, drop)
    changed = pool.take(never_dropped)
    shapes[changed] = KeyspaceShape("rf3", FRESH.tables, 0)
    pool.give_back(changed, drop)
    others = [f"t_of_test_{n}_without_a_store" for n in range(RETIRED_BATCH - 2)]
    for name in others[:-1]:
        pool.discard(name, drop)
    assert not dropped
    assert pool.take(never_dropped) not in (pooled, changed)  # a waiting keyspace is never handed out

    pool.discard(others[-1], drop)
    assert [s for s in session.statements if s.startswith("DROP")] == [
        f"DROP TABLE IF EXISTS {pooled}.m_queue", f"DROP KEYSPACE {changed}",
        *(f"DROP KEYSPACE {name}" for name in others)]


def test_the_drops_still_waiting_run_when_the_session_ends(shapes: dict[str, KeyspaceShape]) -> None:
    session = RecordingSession()
    pool = KeyspacePool(session, "rf1")  # type: ignore[arg-type]
    dropped: list[str] = []
    pool.discard("t_left", lambda _, keyspace: dropped.append(keyspace))
    assert not dropped
    pool.drop_waiting(lambda _, keyspace: dropped.append(keyspace))
    assert dropped == ["t_left"]


def test_a_keyspace_given_back_as_made_is_taken_again_at_once(shapes: dict[str, KeyspaceShape]) -> None:
    session = RecordingSession()
    pool = KeyspacePool(session, "rf1")  # type: ignore[arg-type]
    first = pool.take(never_dropped)
    pool.give_back(first, never_dropped)
    assert pool.take(never_dropped) == first


def test_a_keyspace_a_test_changed_is_dropped_whole(shapes: dict[str, KeyspaceShape]) -> None:
    session = RecordingSession()
    pool = KeyspacePool(session, "rf1")  # type: ignore[arg-type]
    name = pool.take(never_dropped)
    shapes[name] = KeyspaceShape("rf3", FRESH.tables, 0)
    dropped: list[str] = []
    pool.give_back(name, lambda _, keyspace: dropped.append(keyspace))
    assert pool.take(never_dropped) != name
    pool.drop_waiting(lambda _, keyspace: dropped.append(keyspace))
    assert dropped == [name]
