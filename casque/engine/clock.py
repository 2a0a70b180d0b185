"""One wall clock for every process of an installation: Cassandra's.

A delivery's visibility runs on its holder's monotonic clock and never leaves the process.
Some times, though, are written by one process and judged by another: a shared claim's
`until` (written by its holder, judged by every member), `deliverAt` (a publisher turns a
delay into it, the mover judges it due), an idempotency intent's deadline, a batch's publish
time (a seek to a time compares those of all shards). With each process on its own wall
clock, a sidecar 5 s ahead would move delayed messages 5 s early and take claims over while
their holders still deliver from them. So these times are read from one clock: the local
wall clock plus an offset to Cassandra's, which already decides every row's TTL.

The offset is sampled with a read of the coordinator's time (`now()` of `system.local`, no
replica involved) and taken from the sample with the shortest round trip of a few, so its
error is half that round trip (a millisecond on a LAN) plus the server's millisecond
resolution. It is sampled again every SAMPLE_SECONDS, in the background, which also follows
a local clock stepped by NTP or by hand. Until the first sample (or when Cassandra cannot
be reached), the offset stays where it was: 0 at first, the local clock. A process samples
once before it serves (`sample`), so a sidecar never judges a time on its own clock.

Cassandra's nodes are assumed to be NTP-synchronised: their write timestamps and TTLs
already depend on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from datetime import datetime, timezone

from cassandra.cluster import Session

from casque.backends import cql

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 30.0
# Round trips per sample; the shortest one's reading is kept.
TRIES = 3
_NOW = "SELECT toUnixTimestamp(now()) AS now_ms FROM system.local"


class BackendClock:
    def __init__(self, session: Session) -> None:
        self._session = session
        # Seconds to add to the local wall clock to read Cassandra's.
        self.offset = 0.0
        # Half the round trip of the sample in use (None: not sampled yet).
        self.error: float | None = None
        self._sampled_at: float | None = None  # monotonic
        self._refreshing: asyncio.Task[None] | None = None

    def time(self) -> float:
        """Seconds since the epoch, on Cassandra's clock."""
        self._refresh_if_due()
        return time.time() + self.offset

    def ms(self) -> int:
        return int(self.time() * 1000)

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.time(), timezone.utc)

    def wall_of(self, monotonic: float) -> float:
        """A deadline on this process's monotonic clock, on Cassandra's clock."""
        return monotonic - time.monotonic() + self.time()

    async def sample(self) -> None:
        """Measure the offset now (raises if Cassandra cannot be reached)."""
        best: tuple[float, float] | None = None  # (round trip, offset)
        for _ in range(TRIES):
            started, wall = time.monotonic(), time.time()
            row = (await cql.execute(self._session, _NOW)).one()
            trip = time.monotonic() - started
            server = _now_ms(row) / 1000
            offset = server - (wall + trip / 2)
            if best is None or trip < best[0]:
                best = (trip, offset)
        assert best is not None
        if self.error is None or abs(best[1] - self.offset) > 0.5:
            log.info("clock: Cassandra's wall clock is %+.3f s from this process's (±%.1f ms)", best[1],
                     best[0] * 500)
        self.offset, self.error = best[1], best[0] / 2
        self._sampled_at = time.monotonic()

    def _refresh_if_due(self) -> None:
        if self._sampled_at is not None and time.monotonic() - self._sampled_at < SAMPLE_SECONDS:
            return
        if self._refreshing is not None and not self._refreshing.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a thread without a loop: the offset as last sampled
        self._sampled_at = time.monotonic()  # one try per SAMPLE_SECONDS, whatever it gives
        self._refreshing = loop.create_task(self._refresh())

    async def _refresh(self) -> None:
        try:
            await self.sample()
        except Exception as error:  # the last offset still holds; the next period tries again
            log.debug("clock: sample failed (%s); keeping an offset of %+.3f s", error, self.offset)


def _now_ms(row: object) -> int:
    if isinstance(row, tuple):
        return int(row[0])
    return int(getattr(row, "now_ms"))


_clocks: weakref.WeakKeyDictionary[Session, BackendClock] = weakref.WeakKeyDictionary()


def clock_of(session: Session) -> BackendClock:
    """The clock of a Cassandra session: one per connection, shared by everything on it."""
    clock = _clocks.get(session)
    if clock is None:
        clock = _clocks[session] = BackendClock(session)
    return clock
