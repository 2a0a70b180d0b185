"""Trust in a member's ZooKeeper session: whether it is known to be alive now.

A lease is an ephemeral znode, so it lasts as long as the session, and a member paused past
its session (GC, SIGSTOP) resumes believing it still holds shards the others took meanwhile.
Until its client notices, it would hand out messages it no longer owns. So a member hands
out messages only while its session is known to be alive: until half a session timeout
after sending the last request ZooKeeper answered for that session (a heartbeat every
quarter timeout). The timeout is the one the server granted at the client's last connect
(`zk.granted_session_seconds`), never the one asked for: the server bounds a request by its
maxSessionTimeout (20 ticks by default) and expires the session on what it granted, so
120 s asked of a server whose maximum is 40 s would be trusted for 60 s of a session that
ends after 40. The server cannot expire a session sooner than a full granted timeout after
it heard from it, so the other half absorbs clock-rate differences. A reconnect negotiates
again (another server's limits, or a new session after an expiry) and the window follows
the latest grant, which is safe either way: a reconnect that keeps the session renews it
for the new grant from then on.

The heartbeats never end while the member runs: a member whose heartbeats stopped would
stop handing out messages half a session later and never start again, with every probe
still answering. A kazoo client has no session id while it is disconnected, and an answer
can arrive just as the connection drops: such an answer confirms nothing, and the next
heartbeat tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kazoo.client import KazooClient

from casque.backends import zk
from casque.errors import BackendUnavailable

log = logging.getLogger(__name__)

HEARTBEATS_PER_SESSION = 4


def session_of(client: KazooClient) -> int | None:
    """The client's ZooKeeper session id now; None while it is disconnected."""
    client_id = client.client_id
    return int(client_id[0]) if client_id else None


class SessionTrust:
    def __init__(self, client: KazooClient, probe_path: str, connected: Callable[[], bool],
                 on_trusted: Callable[[], None]) -> None:
        """`probe_path`: an ephemeral znode of the session (the member's), read by each heartbeat;
        `connected`: whether the client is connected as far as its state listener knows."""
        self._client = client
        self._probe_path = probe_path
        self._connected = connected
        self._on_trusted = on_trusted
        # Monotonic time at which the last request that ZooKeeper answered for the session was
        # sent, and that session's id.
        self._confirmed_at = float("-inf")
        self.confirmed_session: int | None = None
        # Heartbeats done, answered or not.
        self.heartbeats = 0
        self._beat_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # A client that cannot tell its granted timeout fails here rather than at the first receive.
        zk.granted_session_seconds(client)

    @property
    def session_seconds(self) -> float:
        """The session timeout the server granted at the last connect."""
        return zk.granted_session_seconds(self._client)

    @property
    def trusted(self) -> bool:
        """Whether the session is known to be alive now."""
        if not self._connected():
            return False
        if self._within_window():
            return True
        self._beat_now.set()  # find out at once rather than at the next heartbeat
        return False

    def confirms(self, session: int | None) -> bool:
        """Whether `session` is the one the last answered heartbeat confirmed, within the window."""
        return session is not None and session == self.confirmed_session and self._within_window()

    @property
    def unconfirmed(self) -> str:
        """Since when the session has not been confirmed alive, for a status line."""
        if self._confirmed_at == float("-inf"):
            return "since the member started"
        return f"for {time.monotonic() - self._confirmed_at:.0f}s"

    def _within_window(self) -> bool:
        return time.monotonic() < self._confirmed_at + self.session_seconds / 2

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._heartbeats())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self._beat()
            except Exception as error:  # never ends the heartbeats: the next one tries again
                log.warning("ZooKeeper heartbeat failed (%s: %s)", type(error).__name__, error)
            self.heartbeats += 1
            self._beat_now.clear()
            try:
                await asyncio.wait_for(self._beat_now.wait(), self.session_seconds / HEARTBEATS_PER_SESSION)
            except TimeoutError:
                pass

    async def _beat(self) -> None:
        """Read the probe znode; if the session that owns it is the one the request was sent in
        and still the client's after the answer, the session was alive when it was sent."""
        sent = time.monotonic()
        session = session_of(self._client)
        try:
            stat = await zk.call(self._client.exists_async, self._probe_path)
        except BackendUnavailable:  # connection loss or expiry: trust lapses until an answer comes
            return
        if session is None or stat is None or stat.ephemeralOwner != session or session_of(self._client) != session:
            return
        was = self.trusted
        if sent >= self._confirmed_at:
            self._confirmed_at = sent
            self.confirmed_session = session
        if not was:
            self._on_trusted()
