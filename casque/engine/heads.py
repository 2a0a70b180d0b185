"""The shard head znode: the published watermark. Every batch <= head exists (or has expired).

Recipe guarantees:
- `advance` only ever raises the value (compare-and-set on the znode version), so racing
  publishers cannot move it back, and the contiguity of batches makes any batch a writer
  has written a valid watermark.
- Advances are coalesced per shard: while one compare-and-set is in flight, later targets
  collapse into the highest one, so ZooKeeper sees at most one write in flight per shard
  however many batches are written.

Connection states: while SUSPENDED, advances wait in kazoo's retry and may fail with
BackendUnavailable; a head left behind is harmless, since readers read past it and the
next publisher that meets batch head+1 advances it. Nothing here depends on a session,
so LOST needs no action.
"""

from __future__ import annotations

import asyncio

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError

from casque.backends import zk


class HeadAdvancer:
    def __init__(self, client: KazooClient, path: str) -> None:
        self._client = client
        self._path = path
        self._target = 0
        self._known = 0
        self._version: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        self.reads = 0

    def advance(self, batch: int) -> None:
        """Ask for head >= batch; returns at once, the write happens in the background."""
        if batch <= max(self._target, self._known):
            return
        self._target = batch
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait(self) -> None:
        """Wait until every requested advance is written (tests and shutdown)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        while self._target > self._known:
            target = self._target
            try:
                if self._version is None:
                    data, stat = await zk.call(self._client.get_async, self._path)
                    self.reads += 1
                    self._known, self._version = int(data or b"0"), stat.version
                    continue
                stat = await zk.call(self._client.set_async, self._path, str(target).encode(), self._version)
                self.writes += 1
                self._known, self._version = target, stat.version
            except BadVersionError:
                self._version = None  # someone else moved it: read and compare again
            except Exception:
                # The watermark may lag; readers read past it and the next advance fixes it.
                self._version = None
                return
