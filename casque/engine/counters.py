"""Durable running counts per queue, for statistics: delayed in and out, dead-lettered, filtered."""

from __future__ import annotations

from casque.backends import cql
from casque.schema import COUNTERS_TABLE
from casque.store import Store

DELAYED_IN = "delayed_in"
DELAYED_OUT = "delayed_out"


def dead_lettered(subscriber_key: str) -> str:
    """`subscriber_key`: the subscriber's incarnation key (`SubscriberState.ack_key`)."""
    return f"dead_lettered:{subscriber_key}"


def filtered(subscriber_key: str) -> str:
    """Messages the subscriber's filter did not match; `subscriber_key` as for dead_lettered."""
    return f"filtered:{subscriber_key}"


class QueueCounters:
    def __init__(self, store: Store, queue_key: str) -> None:
        """`queue_key`: the queue's incarnation key (`QueueState.shared_key`)."""
        self._store = store
        self._queue = queue_key
        table = f"{store.namespace_view_keyspace('queue counters')}.{COUNTERS_TABLE}"
        self._add = store.session.prepare(f"UPDATE {table} SET value = value + ? WHERE queue = ? AND name = ?")
        self._read = store.session.prepare(f"SELECT name, value FROM {table} WHERE queue = ?")

    async def add(self, name: str, amount: int) -> None:
        await cql.execute(self._store.session, self._add, (amount, self._queue, name))

    async def read(self) -> dict[str, int]:
        rows = await cql.execute(self._store.session, self._read, (self._queue,))
        return {row.name: int(row.value) for row in rows}
