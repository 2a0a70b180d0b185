"""The installation's backends, opened for one command that works on them synchronously."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from casque.cli.options import backend_settings
from casque.store import Store


@contextmanager
def installation(cassandra: str | None, zookeeper: str | None, keyspace: str | None) -> Iterator[Store]:
    """A Store on the backends the options name (or the CASQUE_* settings), closed after."""
    store = Store.open(backend_settings(cassandra, zookeeper, keyspace))
    try:
        yield store
    finally:
        store.close()
