"""Finding Cassandra again when every node it knew has moved to a new address.

The driver resolves its contact points once, when the Cluster is made, and from then on knows
nodes only by address. A Cassandra pod that a StatefulSet replaces comes back under its old
name with a new IP; in a ring the other nodes gossip the new address to the driver, but when
every known node is gone at once (a single node, or the whole ring restarted) nothing tells
it, and it retries the old addresses for ever: the process answers 503 until it is restarted.

So while no known node is up, the contact points are resolved again every few seconds, and
every address they now name that the driver does not know is added as a node. The driver
then connects to it like to any node it discovered: its control connection reads the ring
from it and drops the old addresses that are no longer in it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Sequence

from cassandra.cluster import Cluster
from cassandra.connection import DefaultEndPoint
from cassandra.policies import HostStateListener
from cassandra.pool import Host

log = logging.getLogger(__name__)

# How often the contact points are resolved again while no node is up: about the driver's
# first reconnection delays, so a node that is back under its old address is found by the
# driver first.
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


class ContactPointRediscovery(HostStateListener):  # type: ignore[misc]
    """Listens to the driver's node states; while none is up, adds the nodes that the contact
    points name now (see the module's docstring)."""

    def __init__(self, cluster: Cluster, names: Sequence[str], port: int, datacenter: str | None,
                 resolve: Resolve = resolve) -> None:
        self._cluster = cluster
        self._names = list(names)
        self._port = port
        self._datacenter = datacenter
        self._resolve = resolve
        self._lock = threading.Lock()
        self._pending = False

    def on_up(self, host: Host) -> None:
        pass

    def on_down(self, host: Host) -> None:
        self._schedule()

    def on_add(self, host: Host) -> None:
        pass

    def on_remove(self, host: Host) -> None:
        pass

    def _none_up(self) -> bool:
        return not any(host.is_up for host in self._cluster.metadata.all_hosts())

    def _schedule(self) -> None:
        with self._lock:
            if self._pending or self._cluster.is_shutdown:
                return
            self._pending = True
        self._cluster.scheduler.schedule(INTERVAL_SECONDS, self._check)

    def _check(self) -> None:
        with self._lock:
            self._pending = False
        if self._cluster.is_shutdown or not self._none_up():
            return
        try:
            self.rediscover()
        except Exception:  # a failure here must not end the retries; the next check may succeed
            log.exception("resolving Cassandra's contact points again failed")
        if self._none_up():
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
