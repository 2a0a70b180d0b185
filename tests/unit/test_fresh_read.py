"""FreshRead: concurrent ack calls share the seek-mark read, each answered by a read sent after it asked."""

from __future__ import annotations

import asyncio

import pytest

from casque.engine.acking import FreshRead


class Store:
    """A value that changes, read with a delay the test controls."""

    def __init__(self) -> None:
        self.value = 0
        self.reads = 0
        self.release = asyncio.Event()
        self.fail: Exception | None = None

    async def read(self) -> int:
        self.reads += 1
        seen = self.value  # what the store says when the read is sent
        await self.release.wait()
        self.release.clear()
        if self.fail is not None:
            raise self.fail
        return seen


async def _until(condition: object) -> None:
    for _ in range(100):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_callers_side_by_side_share_one_read() -> None:
    store = Store()
    shared = FreshRead(store.read)
    callers = [asyncio.create_task(shared.get()) for _ in range(10)]
    await _until(lambda: store.reads == 1)
    store.release.set()
    assert await asyncio.gather(*callers) == [0] * 10
    assert store.reads == 1


async def test_a_caller_never_joins_a_read_sent_before_it_asked() -> None:
    store = Store()
    shared = FreshRead(store.read)
    early = asyncio.create_task(shared.get())
    await _until(lambda: store.reads == 1)  # the read for `early` is under way ...
    store.value = 1  # ... and the store changes after it was sent
    late = [asyncio.create_task(shared.get()) for _ in range(3)]
    await asyncio.sleep(0)
    store.release.set()
    assert await early == 0
    await _until(lambda: store.reads == 2)  # the late callers share the next read, sent after they asked
    store.release.set()
    assert await asyncio.gather(*late) == [1, 1, 1]


async def test_a_failed_read_fails_its_callers_only() -> None:
    store = Store()
    shared = FreshRead(store.read)
    store.fail = ConnectionError("lost")
    failing = [asyncio.create_task(shared.get()) for _ in range(2)]
    await _until(lambda: store.reads == 1)
    store.release.set()
    for caller in failing:
        with pytest.raises(ConnectionError):
            await caller
    store.fail = None
    after = asyncio.create_task(shared.get())
    await _until(lambda: store.reads == 2)
    store.release.set()
    assert await after == 0


async def test_a_cancelled_caller_leaves_the_read_to_the_others() -> None:
    store = Store()
    shared = FreshRead(store.read)
    leaving, staying = asyncio.create_task(shared.get()), asyncio.create_task(shared.get())
    await _until(lambda: store.reads == 1)
    leaving.cancel()
    store.release.set()
    assert await staying == 0
    with pytest.raises(asyncio.CancelledError):
        await leaving
