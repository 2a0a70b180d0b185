"""The sidecar's publishers, one per queue it publishes to: made on first use, and replaced
when the queue's spec changes (shards, size limit, schema) or the queue goes. A replacement
takes over the ids its predecessor still publishes (IdempotencyGuard.continue_from): a retry
that reaches the new publisher while the first attempt is being written waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

from kazoo.recipe.watchers import DataWatch

from casque.engine.publisher import Publisher
from casque.backends.loop_handoff import call_soon_unless_closed
from casque.store import Store


class QueuePublishers:
    def __init__(self, store: Store, make: Callable[[str], Awaitable[Publisher]]) -> None:
        """`make(name)`: a new publisher of queue `name`, its spec read now."""
        self._store = store
        self._make = make
        self._current: dict[str, Publisher] = {}
        # The publisher a spec change replaced, by queue, until its successor is made.
        self._replaced: dict[str, Publisher] = {}
        self._loading: dict[str, asyncio.Task[Publisher]] = {}

    async def get(self, name: str) -> Publisher:
        known = self._current.get(name)
        if known is not None:
            return known
        loading = self._loading.get(name)
        if loading is None:
            loading = asyncio.get_running_loop().create_task(self._load(name))
            self._loading[name] = loading
            loading.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(loading)

    def __iter__(self) -> Iterator[Publisher]:
        """Every publisher that may still write: the current ones and those just replaced."""
        return iter([*self._current.values(), *self._replaced.values()])

    async def _load(self, name: str) -> Publisher:
        publisher = await self._make(name)
        replaced = self._replaced.pop(name, None)
        if replaced is not None and replaced.state.incarnation == publisher.state.incarnation:
            publisher.idempotency.continue_from(replaced.idempotency)
        self._current[name] = publisher
        self._watch_spec(name, publisher)
        return publisher

    def _watch_spec(self, name: str, publisher: Publisher) -> None:
        """Forget the publisher when its queue's spec changes or the queue goes."""
        loop = asyncio.get_running_loop()

        def forget() -> None:
            if self._current.get(name) is publisher:
                del self._current[name]
                self._replaced[name] = publisher

        def changed(data: bytes | None, stat: object, event: object = None) -> bool:
            if self._current.get(name) is not publisher or loop.is_closed():
                return False  # replaced already: drop this watch
            if event is not None:
                call_soon_unless_closed(loop, forget)
                return False
            return True

        DataWatch(self._store.zk, self._store.paths(publisher.queue).base, changed)
