"""Whether a member reaches Cassandra, and when it should give up its share for not reaching it.

Recipe: a member cut off from Cassandra but not from ZooKeeper still holds its leases (and,
in shared delivery, renews its claims while its app asks): ZooKeeper says its shards are
taken, so nobody else reads them, and they stall while every receive and ack it answers
fails. So the member probes Cassandra (a read at the queue's consistency, which needs the
replicas a delivery needs) every quarter of the bound below, and once no probe has been
answered for the whole bound it is `unreachable`: the member steps back (leaves the group,
hands its shards over, lets its claims lapse; casque.engine.consumer) and rejoins when a
probe is answered again.

The bound is the ZooKeeper session timeout the server granted. A member cut off from
ZooKeeper loses its shards one session after its last word; one cut off from Cassandra gives
them up after the same time, so either partition costs the group the same, and a hiccup
shorter than a session (a node's GC pause, a coordinator restarting) moves nothing. A probe
that hangs (a blackholed link answers nothing) counts as unanswered from the moment it was
sent: the verdict is taken on time, not on the probe's own timeout.

Connection states: none; ZooKeeper's are the lease recipe's (casque.engine.leases).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

PROBES_PER_BOUND = 4


class CassandraReach:
    def __init__(self, probe: Callable[[], Awaitable[object]], bound: Callable[[], float],
                 on_change: Callable[[bool], None]) -> None:
        """`probe`: one read that succeeds when Cassandra answers; `bound`: seconds without an
        answer after which Cassandra counts as unreachable (read at every check: a reconnect
        to ZooKeeper may grant another session timeout); `on_change(reachable)` is called
        on each verdict that differs from the last."""
        self._probe = probe
        self._bound = bound
        self._on_change = on_change
        self.reachable = True
        self._answered_at = time.monotonic()
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def problem(self) -> str:
        """Why this member stepped back, or empty while Cassandra answers."""
        if self.reachable:
            return ""
        silent = time.monotonic() - self._answered_at
        why = f" ({self.last_error})" if self.last_error else ""
        return (f"Cassandra unreachable for {silent:.0f}s{why}: shards given up to the other members "
                f"until it answers again")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        probing: asyncio.Task[None] | None = None
        while True:
            if probing is None or probing.done():
                probing = asyncio.get_running_loop().create_task(self._probe_once())
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self._bound() / PROBES_PER_BOUND)
            except TimeoutError:
                pass
            self._judge()

    async def _probe_once(self) -> None:
        try:
            await self._probe()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # any failure is an unanswered probe; the next one may succeed
            self.last_error = f"{type(error).__name__}: {error}"
            return
        self._answered_at = time.monotonic()
        self.last_error = ""
        if not self.reachable:
            self._wake.set()  # rejoin now, not at the next check

    def _judge(self) -> None:
        reachable = time.monotonic() - self._answered_at <= self._bound()
        if reachable == self.reachable:
            return
        self.reachable = reachable
        if reachable:
            log.warning("Cassandra answers again: rejoining the group")
        else:
            log.warning("%s", self.problem)
        self._on_change(reachable)
