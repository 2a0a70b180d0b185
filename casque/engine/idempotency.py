"""Idempotent publish: a client message id seen within the window returns the first result.

Exact within one sidecar (the app's retries reach its own localhost sidecar): concurrent
publishes of one id wait for the first, and recent ids are remembered in memory. Across
sidecars and restarts, ids are looked up in the `publish_ids` table, whose rows expire after
the window. The id row is written after the batch, before the publish is acknowledged; a
crash between the two can let a retry publish the message again (at-least-once).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from casque.backends import cql
from casque.engine.messages import Published
from casque.schema import PUBLISH_IDS_TABLE, QueueRef
from casque.store import Store

DEFAULT_WINDOW_SECONDS = 600
REMEMBERED_IDS = 100_000


class IdempotencyGuard:
    def __init__(self, store: Store, queue: QueueRef, window_seconds: int = DEFAULT_WINDOW_SECONDS) -> None:
        self._store = store
        self._queue = queue.key
        table = f"{store.keyspace}.{PUBLISH_IDS_TABLE}"
        self._select = store.session.prepare(
            f"SELECT message_id, shard, batch_no, seq FROM {table} WHERE queue = ? AND client_id = ?"
        )
        self._insert = store.session.prepare(
            f"INSERT INTO {table} (queue, client_id, message_id, shard, batch_no, seq) "
            f"VALUES (?, ?, ?, ?, ?, ?) USING TTL {int(window_seconds)}"
        )
        self._recent: OrderedDict[str, Published] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Published]] = {}

    async def publish_once(self, client_id: str, publish: Callable[[], Awaitable[Published]]) -> Published:
        known = self._recent.get(client_id)
        if known is not None:
            return _as_duplicate(known)
        running = self._inflight.get(client_id)
        if running is not None:
            return _as_duplicate(await asyncio.shield(running))
        future: asyncio.Future[Published] = asyncio.get_running_loop().create_future()
        self._inflight[client_id] = future
        try:
            row = (await cql.execute(self._store.session, self._select, (self._queue, client_id))).one()
            if row is not None:
                result = _as_duplicate(Published(row.message_id, row.shard, row.batch_no, row.seq))
            else:
                result = await publish()
                await cql.execute(
                    self._store.session,
                    self._insert,
                    (self._queue, client_id, result.message_id, result.shard, result.batch, result.seq),
                )
            self._remember(client_id, result)
            future.set_result(result)
            return result
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved here: waiters re-raise it themselves
            raise
        finally:
            del self._inflight[client_id]

    def _remember(self, client_id: str, result: Published) -> None:
        self._recent[client_id] = result
        while len(self._recent) > REMEMBERED_IDS:
            self._recent.popitem(last=False)


def _as_duplicate(result: Published) -> Published:
    return Published(result.message_id, result.shard, result.batch, result.seq, duplicate=True,
                     deliver_at=result.deliver_at)
