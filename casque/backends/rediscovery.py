"""Keeping the Cassandra driver trying every node it should reach.

Two ways the driver (3.30) stops trying a node for good, each found on a Kubernetes node
where a Cassandra pod was replaced:

- A node back under a new address. The driver resolves its contact points once, when the
  Cluster is made, and from then on knows nodes only by address. A Cassandra pod that a
  StatefulSet replaces comes back under its old name with a new IP; in a ring the other
  nodes gossip the new address to the driver, but when every known node is gone at once (a
  single node, or the whole ring restarted) nothing tells it, and it retries the old
  addresses for ever. So while no known node is up, the contact points are resolved again
  and every address they now name that the driver does not know is added as a node; its
  control connection then reads the ring from it and drops the old addresses.
- A node that refused a login once. A node that has just started can refuse logins for a
  moment (its roles are not readable yet). The driver takes an `AuthenticationFailed` as
  final: a reconnection that meets one stops, though it stays set on the node as if it
  ran, and a node that meets one as it is added is left neither up nor reconnecting.
  Either way the process answered 503 until restarted. So every reconnection schedule
  notes when its next attempt is due (`WatchedReconnectionPolicy`), and a node that is
  not up and has no reconnection, or one past due, at two checks in a row, has its
  reconnection started again.

Both run in one check, on the driver's scheduler, every few seconds for the Cluster's life:
a node added by the control connection that fails its first login sends no signal to
wait for. Cost: one look at the driver's node list every 2 s.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from cassandra.cluster import Cluster
from cassandra.connection import DefaultEndPoint
from cassandra.policies import ExponentialReconnectionPolicy, HostDistance
from cassandra.pool import Host

log = logging.getLogger(__name__)

# How often the nodes are checked while one is not up: about the driver's reconnection
# delays (RECONNECT_MAX_SECONDS in cql.py), so a node back under its old address is found
# by the driver first.
INTERVAL_SECONDS = 2.0

Resolve = Callable[[str, int], Iterable[str]]


def resolve(name: str, port: int) -> list[str]:
    """The addresses a name stands for now (a headless Service's name: every ready pod)."""
    try:
        found = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in found))


def unknown_addresses(known: Iterable[Host], names: Sequence[str], port: int, resolve: Resolve = resolve) -> list[str]:
    """Addresses the contact points name now that no known node has, in the order named."""
    have = {host.endpoint.address for host in known}
    new: list[str] = []
    for name in names:
        new += [address for address in resolve(name, port) if address not in have and address not in new]
    return new


class WatchedSchedule:
    """A reconnection's delays, noting when the attempt each one leads to is due. A
    reconnection draws a delay after every failed attempt, its last one too, so one whose
    attempt is long past due has stopped."""

    def __init__(self, delays: Iterator[float]) -> None:
        self._delays = delays
        self.due_at = time.monotonic()

    def __iter__(self) -> WatchedSchedule:
        return self

    def __next__(self) -> float:
        delay = next(self._delays)
        self.due_at = time.monotonic() + delay
        return delay


class WatchedReconnectionPolicy(ExponentialReconnectionPolicy):  # type: ignore[misc]
    """The driver's exponential policy, with schedules that can be seen to have stopped."""

    def new_schedule(self) -> WatchedSchedule:
        return WatchedSchedule(super().new_schedule())


def stopped(handler: object | None, now: float, grace: float) -> bool:
    """Whether a node's reconnection (the driver's handler, or None) is not running: none,
    or a watched one whose attempt was due more than `grace` seconds ago."""
    if handler is None:
        return True
    schedule = getattr(handler, "schedule", None)
    return isinstance(schedule, WatchedSchedule) and now > schedule.due_at + grace


def abandoned(hosts: Iterable[Host], ignored: Callable[[Host], bool], now: float, grace: float) -> list[Host]:
    """Nodes the driver is not using and not trying to reach: not up (down, or never up),
    their reconnection `stopped`, and not ignored by the load balancing policy (a remote
    datacenter's nodes are never connected, by design)."""
    # The driver offers no reader of a node's reconnection but a swap; this reads it alone.
    return [host for host in hosts
            if not host.is_up and not ignored(host) and stopped(host._reconnection_handler, now, grace)]


class NodeWatch:
    """Checks the driver's nodes every few seconds: while none is up, finds the nodes the
    contact points name now; restarts reconnections the driver ended (see the module's
    docstring)."""

    def __init__(self, cluster: Cluster, names: Sequence[str], port: int, datacenter: str | None,
                 resolve: Resolve = resolve) -> None:
        self._cluster = cluster
        self._names = list(names)
        self._port = port
        self._datacenter = datacenter
        self._resolve = resolve
        # Nodes abandoned at the last check: one seen so only once may be a node whose
        # addition or coming up is still opening its pools.
        self._abandoned: set[Host] = set()

    def start(self) -> None:
        """Begin checking, once the Cluster is connected (call once)."""
        self._schedule()

    def _none_up(self) -> bool:
        return not any(host.is_up for host in self._cluster.metadata.all_hosts())

    def _schedule(self) -> None:
        if not self._cluster.is_shutdown:
            self._cluster.scheduler.schedule(INTERVAL_SECONDS, self._check)

    def _check(self) -> None:
        if self._cluster.is_shutdown:
            return
        try:
            if self._none_up():
                self.rediscover()
            self.reconnect_abandoned()
        except Exception:  # a failure here must not end the checks; the next one may succeed
            log.exception("checking Cassandra's nodes failed")
        self._schedule()

    def rediscover(self) -> list[str]:
        """Add the addresses the contact points name now and the driver does not know."""
        added = unknown_addresses(self._cluster.metadata.all_hosts(), self._names, self._port, self._resolve)
        for address in added:
            log.warning("no known Cassandra node is up; %s now resolves to %s: trying it",
                        ", ".join(self._names), address)
            self._cluster.add_host(DefaultEndPoint(address, self._port), datacenter=self._datacenter, signal=True,
                                   refresh_nodes=False)
        return added

    def reconnect_abandoned(self) -> list[Host]:
        """Start reconnecting to each node abandoned at this check and the one before."""
        # An attempt may take the connect timeout, and the scheduler may run late.
        grace = self._cluster.connect_timeout + INTERVAL_SECONDS
        now = set(abandoned(self._cluster.metadata.all_hosts(), self._ignored, time.monotonic(), grace))
        again, self._abandoned = now & self._abandoned, now - self._abandoned
        for host in again:
            log.warning("Cassandra node %s is down and the driver stopped trying it (a refused login?): "
                        "reconnecting", host)
            ended = host.get_and_set_reconnection_handler(None)
            if ended is not None:
                ended.cancel()
            # As the driver's own path does for a failed connection, with the flag that makes
            # it start a reconnection; a node never up is added, not marked up, once reached.
            self._cluster.on_down(host, is_host_addition=host.is_up is None, expect_host_to_be_down=True)
        return sorted(again, key=lambda host: str(host.endpoint))

    def _ignored(self, host: Host) -> bool:
        return bool(self._cluster.profile_manager.distance(host) == HostDistance.IGNORED)
