"""Re-resolving Cassandra's contact points when no known node is up (casque.backends.rediscovery)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cassandra.connection import DefaultEndPoint

from casque.backends.rediscovery import ContactPointRediscovery, unknown_addresses


@dataclass
class Node:
    address: str
    is_up: bool | None

    @property
    def endpoint(self) -> DefaultEndPoint:
        return DefaultEndPoint(self.address, 9042)


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


@dataclass
class DriverCluster:
    """The driver's Cluster as far as rediscovery uses it."""
    metadata: Metadata
    scheduler: Scheduler = field(default_factory=Scheduler)
    is_shutdown: bool = False
    added: list[tuple[str, str | None]] = field(default_factory=list)

    def add_host(self, endpoint: DefaultEndPoint, datacenter: str | None, signal: bool, refresh_nodes: bool) -> None:
        self.added.append((endpoint.address, datacenter))
        self.metadata.nodes.append(Node(endpoint.address, None))


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
    rediscovery = ContactPointRediscovery(cluster, ["casque-cassandra.casque.svc"], 9042, "dc1", resolve)  # type: ignore[arg-type]
    cluster.metadata.nodes[0].is_up = False
    rediscovery.on_down(cluster.metadata.nodes[0])  # type: ignore[arg-type]
    rediscovery.on_down(cluster.metadata.nodes[0])  # type: ignore[arg-type]
    assert len(cluster.scheduler.scheduled) == 1, "one check pending at a time"
    cluster.scheduler.scheduled.pop()()
    assert cluster.added == [("10.244.0.13", "dc1")]
    # Not up yet (the driver is connecting to it): the check comes again.
    assert len(cluster.scheduler.scheduled) == 1


def test_nothing_is_added_while_a_known_node_is_up_or_after_shutdown() -> None:
    cluster = DriverCluster(Metadata([Node("10.0.0.1", True), Node("10.0.0.2", False)]))
    rediscovery = ContactPointRediscovery(cluster, ["ring"], 9042, None, names({"ring": ["10.0.0.9"]}))  # type: ignore[arg-type]
    rediscovery.on_down(cluster.metadata.nodes[1])  # type: ignore[arg-type]
    cluster.scheduler.scheduled.pop()()
    assert cluster.added == [] and cluster.scheduler.scheduled == []
    cluster.metadata.nodes[0].is_up = False
    cluster.is_shutdown = True
    rediscovery.on_down(cluster.metadata.nodes[0])  # type: ignore[arg-type]
    assert cluster.scheduler.scheduled == []
