"""Keeping the Cassandra driver trying every node (casque.backends.rediscovery): re-resolving
the contact points while no known node is up, and restarting reconnections the driver ended."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cassandra.connection import DefaultEndPoint
from cassandra.policies import HostDistance

from casque.backends.rediscovery import NodeWatch, WatchedReconnectionPolicy, WatchedSchedule, stopped, unknown_addresses


@dataclass
class Reconnection:
    """The driver's reconnection handler: its schedule, and whether it was cancelled."""
    schedule: WatchedSchedule = field(default_factory=lambda: WatchedSchedule(iter([2.0] * 100)))
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(eq=False)
class Node:
    address: str
    is_up: bool | None
    _reconnection_handler: Reconnection | None = None
    remote: bool = False

    @property
    def endpoint(self) -> DefaultEndPoint:
        return DefaultEndPoint(self.address, 9042)

    def get_and_set_reconnection_handler(self, new: Reconnection | None) -> Reconnection | None:
        old, self._reconnection_handler = self._reconnection_handler, new
        return old


@dataclass
class Metadata:
    nodes: list[Node]

    def all_hosts(self) -> list[Node]:
        return list(self.nodes)


@dataclass
class Scheduler:
    scheduled: list[Any] = field(default_factory=list)

    def schedule(self, delay: float, fn: Any) -> None:
        self.scheduled.append(fn)

    def run_next(self) -> None:
        assert len(self.scheduled) == 1, "one check pending at a time"
        self.scheduled.pop()()


class Profiles:
    def distance(self, node: Node) -> int:
        return HostDistance.IGNORED if node.remote else HostDistance.LOCAL


@dataclass
class DriverCluster:
    """The driver's Cluster as far as the watch uses it."""
    metadata: Metadata
    scheduler: Scheduler = field(default_factory=Scheduler)
    profile_manager: Profiles = field(default_factory=Profiles)
    is_shutdown: bool = False
    connect_timeout: float = 5.0
    added: list[tuple[str, str | None]] = field(default_factory=list)
    downs: list[tuple[str, bool, bool]] = field(default_factory=list)

    def add_host(self, endpoint: DefaultEndPoint, datacenter: str | None, signal: bool, refresh_nodes: bool) -> None:
        self.added.append((endpoint.address, datacenter))
        self.metadata.nodes.append(Node(endpoint.address, None))

    def on_down(self, host: Node, is_host_addition: bool, expect_host_to_be_down: bool) -> None:
        self.downs.append((host.address, is_host_addition, expect_host_to_be_down))
        host.is_up, host._reconnection_handler = False, Reconnection()


def names(table: dict[str, list[str]]) -> Any:
    def resolve(name: str, port: int) -> Iterable[str]:
        assert port == 9042
        return table.get(name, [])
    return resolve


def test_only_addresses_no_known_node_has_are_new_once_each_in_the_order_named() -> None:
    known = [Node("10.0.0.3", False)]
    resolve = names({"cassandra.db.svc": ["10.0.0.3", "10.0.0.7"], "cassandra-0.peers": ["10.0.0.7", "10.0.0.8"]})
    assert unknown_addresses(known, ["cassandra.db.svc", "cassandra-0.peers", "gone"], 9042, resolve) == [
        "10.0.0.7", "10.0.0.8"]


def test_a_replaced_single_node_is_added_under_its_new_address_while_none_is_up() -> None:
    cluster = DriverCluster(Metadata([Node("10.244.0.3", True)]))
    resolve = names({"casque-cassandra.casque.svc": ["10.244.0.13"]})
    watch = NodeWatch(cluster, ["casque-cassandra.casque.svc"], 9042, "dc1", resolve)  # type: ignore[arg-type]
    watch.start()
    cluster.scheduler.run_next()
    assert cluster.added == [], "a node is up"
    cluster.metadata.nodes[0].is_up, cluster.metadata.nodes[0]._reconnection_handler = False, Reconnection()
    cluster.scheduler.run_next()
    assert cluster.added == [("10.244.0.13", "dc1")]
    # Not up yet (the driver is connecting to it): the checks go on, and it is not added twice.
    cluster.scheduler.run_next()
    assert cluster.added == [("10.244.0.13", "dc1")]
    assert len(cluster.scheduler.scheduled) == 1


def test_a_reconnection_has_stopped_when_none_is_set_or_its_attempt_is_past_due_beyond_grace() -> None:
    schedule = WatchedReconnectionPolicy(0.2, 2.0, max_attempts=None).new_schedule()
    delays = [next(schedule) for _ in range(8)]
    assert all(0.2 <= delay <= 2.0 for delay in delays) and delays[-1] >= 2.0 * 0.85
    reconnection = Reconnection(schedule)
    due = schedule.due_at
    assert not stopped(reconnection, due + 6.9, grace=7.0)
    assert stopped(reconnection, due + 7.1, grace=7.0)
    assert stopped(None, due, grace=7.0)
    assert not stopped(object(), due + 100, grace=7.0), "a reconnection not watched is trusted"


def past_due() -> Reconnection:
    reconnection = Reconnection()
    reconnection.schedule.due_at -= 60
    return reconnection


def test_a_node_the_driver_stopped_trying_is_reconnected_once_seen_so_twice_in_a_row() -> None:
    gave_up = past_due()
    up, refused, added_refused, reconnecting, remote = (
        Node("10.0.0.1", True), Node("10.0.0.2", False, gave_up), Node("10.0.0.3", None),
        Node("10.0.0.4", False, Reconnection()), Node("10.1.0.1", None, remote=True))
    cluster = DriverCluster(Metadata([up, refused, added_refused, reconnecting, remote]))
    watch = NodeWatch(cluster, ["ring"], 9042, None, names({"ring": ["10.0.0.9"]}))  # type: ignore[arg-type]
    watch.start()
    cluster.scheduler.run_next()
    assert cluster.downs == [], "seen once: it may still be opening its pools"
    cluster.scheduler.run_next()
    # A node that was up comes back through on_up, one never up through on_add.
    assert sorted(cluster.downs) == [("10.0.0.2", False, True), ("10.0.0.3", True, True)]
    assert gave_up.cancelled, "the stopped reconnection is cancelled, not left to resume"
    assert cluster.added == [], "a node is up: nothing is resolved"
    # Its new reconnection stops again (another refused login): seen twice more, started again.
    refused._reconnection_handler = past_due()
    cluster.scheduler.run_next()
    cluster.scheduler.run_next()
    assert cluster.downs[2:] == [("10.0.0.2", False, True)]


def test_a_node_up_again_between_two_checks_is_left_alone_and_shutdown_ends_the_checks() -> None:
    node = Node("10.0.0.2", False)
    cluster = DriverCluster(Metadata([Node("10.0.0.1", True), node]))
    watch = NodeWatch(cluster, ["ring"], 9042, None, names({}))  # type: ignore[arg-type]
    watch.start()
    cluster.scheduler.run_next()
    node.is_up = True
    cluster.scheduler.run_next()
    node.is_up = False
    cluster.scheduler.run_next()
    assert cluster.downs == [], "not abandoned at two checks in a row"
    cluster.is_shutdown = True
    cluster.scheduler.run_next()
    assert cluster.scheduler.scheduled == []
