"""The shard head znode: the published watermark. Every batch <= head exists (or has expired).

Recipe guarantees:
- `advance` only ever raises the value (compare-and-set on the znode version), so racing
  publishers cannot move it back, and the contiguity of batches makes any batch a writer
  has written a valid watermark.
- Advances are coalesced per shard: while one compare-and-set is in flight, later targets
  collapse into the highest one, so ZooKeeper sees at most one write in flight per shard
  however many batches are written.

- A failed advance (ConnectionLoss, SUSPENDED, a timeout) is tried again with backoff until
  the head is at least the target: a batch written and answered must never wait for the
  next publish to that shard to become visible to readers that follow the head.
- Readers probe past the head themselves (leased readers re-read every few seconds, shared
  members look for batch head+1 when there is nothing to claim) and repair a head they
  find behind (`advance` from the reader's side), for a publisher killed before its advance.

- A publisher's advance carries the running totals of the batch it names (its header's),
  written to the shard's totals znode in the head's own transaction, so the totals znode
  holds the totals as of the head whenever a publisher moved it. A header expires with its
  batch; this copy does not, so a queue idle past its retention still knows its totals and
  its next batch counts on from them. An advance by a reader (a repair) knows no totals
  and leaves the znode as it was: as of an earlier batch, which nobody takes for the head's.

Nothing here depends on a session, so LOST needs no action: the next try reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError
from kazoo.recipe.watchers import DataWatch

from casque.backends import zk
from casque.znodes import decode_head, encode_totals

log = logging.getLogger(__name__)

# A failed advance is tried again after a backoff between these bounds.
RETRY_MIN_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0
# A reader with nothing to read below a shard's head looks for batches past it this often.
PAST_HEAD_PROBE_SECONDS = 5.0


def _stopped(client: KazooClient) -> bool:
    """Whether `stop()` was called on the client (kazoo keeps that in a private event)."""
    stopped = getattr(client, "_stopped", None)
    return bool(stopped is not None and stopped.is_set())


class HeadAdvancer:
    def __init__(self, client: KazooClient, path: str, totals_path: str | None = None,
                 written: Callable[[int, tuple[int, int] | None], None] | None = None) -> None:
        """`written`: told of every batch asked for (it is written), with its totals, at once:
        the head's checkpoint (casque.engine.checkpoints) need not wait for ZooKeeper."""
        self._client = client
        self._written = written
        self._path = path
        self._totals_path = totals_path
        self._target = 0
        # The running totals (messages, bytes) as of the target batch, if its writer said.
        self._target_totals: tuple[int, int] | None = None
        self._known = 0
        self._version: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        self.reads = 0
        self.failures = 0

    def advance(self, batch: int, totals: tuple[int, int] | None = None) -> None:
        """Ask for head >= batch; returns at once, the write happens in the background.
        `totals`: the shard's running totals as of `batch`, written with the head."""
        if batch <= max(self._target, self._known):
            return
        if self._written is not None:
            self._written(batch, totals)
        self._target = batch
        self._target_totals = totals
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait(self) -> None:
        """Wait until every requested advance is written (tests and shutdown)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        backoff = RETRY_MIN_SECONDS
        while self._target > self._known:
            target = self._target
            try:
                if self._version is None:
                    data, stat = await zk.call(self._client.get_async, self._path)
                    self.reads += 1
                    self._known, self._version = decode_head(data), stat.version
                    continue
                version = await self._write(target, self._target_totals)
                self.writes += 1
                self._known, self._version = target, version
                backoff = RETRY_MIN_SECONDS
            except BadVersionError:
                self._version = None  # someone else moved it: read and compare again
            except Exception as error:  # every ZooKeeper failure: the head must still get there
                self._version = None
                self.failures += 1
                if _stopped(self._client):
                    # The client was stopped for good (its owner ends): the readers repair the head.
                    log.info("head %s left at %d of %d: the ZooKeeper client stopped", self._path, self._known,
                             target)
                    return
                # Once a loss, not at every try: a ZooKeeper away for minutes is one line.
                (log.warning if backoff == RETRY_MIN_SECONDS else log.debug)(
                    "head %s not advanced to %d (%s); trying again until it is", self._path, target, error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_SECONDS)


    async def _write(self, target: int, totals: tuple[int, int] | None) -> int:
        """The head set to `target` (and the totals znode, when known) over the version we
        read; the head's new version. BadVersionError if someone else moved the head."""
        if totals is None or self._totals_path is None:
            stat = await zk.call(self._client.set_async, self._path, str(target).encode(), self._version)
            return int(stat.version)
        transaction = self._client.transaction()
        transaction.set_data(self._path, str(target).encode(), self._version)
        # Unconditional: it rides on the head's compare-and-set, which only ever goes up.
        transaction.set_data(self._totals_path, encode_totals(target, *totals))
        head, written = await zk.call(transaction.commit_async)
        if isinstance(head, BadVersionError):
            raise head
        if isinstance(written, NoNodeError):
            # A queue made before totals were kept: its znode is made once, then written.
            try:
                await zk.call(self._client.create_async, self._totals_path, b"")
            except NodeExistsError:
                pass
            return await self._write(target, totals)
        failure = next((r for r in (head, written) if isinstance(r, Exception) and not isinstance(r, RolledBackError)),
                       None)
        if failure is not None:
            raise failure
        return int(head.version)


class WatchedHeads:
    """The heads of a queue's shards as their watches report them, for a member that reads past
    them: when to look beyond a head, and the advancers that repair a head found behind."""

    def __init__(self, client: KazooClient, path_of: Callable[[int], str], on_change: Callable[[], None],
                 active: Callable[[], bool]) -> None:
        self._client = client
        self._path_of = path_of
        self._on_change = on_change
        self._active = active
        self._heads: dict[int, int] = {}
        self._probed_at: dict[int, float] = {}
        self._repairs: dict[int, HeadAdvancer] = {}

    def watch(self, shard: int) -> None:
        if shard in self._heads:
            return
        self._heads[shard] = 0

        def changed(data: bytes | None, *_: object) -> None:
            if data:
                self._heads[shard] = max(self._heads.get(shard, 0), decode_head(data))
            self._on_change()

        DataWatch(self._client, self._path_of(shard),
                  zk.watch_in_loop(asyncio.get_running_loop(), changed, self._active))

    def get(self, shard: int) -> int:
        return self._heads.get(shard, 0)

    def probe_due(self, shard: int) -> bool:
        """Whether to look past the shard's head now (at most every PAST_HEAD_PROBE_SECONDS)."""
        now = time.monotonic()
        if now - self._probed_at.get(shard, float("-inf")) < PAST_HEAD_PROBE_SECONDS:
            return False
        self._probed_at[shard] = now
        return True

    def found(self, shard: int, batch: int) -> None:
        """Batch `batch` exists past the head as known: take it as the head, and repair the znode."""
        self._heads[shard] = max(self._heads.get(shard, 0), batch)
        advancer = self._repairs.get(shard)
        if advancer is None:
            advancer = self._repairs[shard] = HeadAdvancer(self._client, self._path_of(shard))
        advancer.advance(batch)
