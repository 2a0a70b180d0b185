"""Which Paxos consistency claims use: never LOCAL_SERIAL when the keyspace spans datacenters."""

from __future__ import annotations

import pytest
from cassandra import ConsistencyLevel

from casque.backends import cql

NTS = "org.apache.cassandra.locator.NetworkTopologyStrategy"
SIMPLE = "org.apache.cassandra.locator.SimpleStrategy"


@pytest.mark.parametrize("write, spans, serial", [
    ("LOCAL_QUORUM", False, ConsistencyLevel.LOCAL_SERIAL),
    ("LOCAL_ONE", False, ConsistencyLevel.LOCAL_SERIAL),
    ("LOCAL_QUORUM", True, ConsistencyLevel.SERIAL),
    ("LOCAL_ONE", True, ConsistencyLevel.SERIAL),
    ("QUORUM", False, ConsistencyLevel.SERIAL),
    ("EACH_QUORUM", True, ConsistencyLevel.SERIAL),
    ("ONE", False, ConsistencyLevel.SERIAL),
])
def test_claims_are_local_only_within_one_datacenter(write: str, spans: bool, serial: int) -> None:
    assert cql.serial_consistency(write, spans) == serial


@pytest.mark.parametrize("replication, hosts, datacenters", [
    ({"class": NTS, "dc1": "3"}, ["dc1", "dc1", "dc2"], 1),
    ({"class": NTS, "dc1": "3", "dc2": "3"}, ["dc1", "dc2"], 2),
    ({"class": NTS, "dc1": "3", "dc2": "0"}, ["dc1", "dc2"], 1),
    ({"class": SIMPLE, "replication_factor": "3"}, ["dc1", "dc1"], 1),
    # SimpleStrategy places replicas around the ring, whatever datacenter its nodes are in.
    ({"class": SIMPLE, "replication_factor": "3"}, ["dc1", "dc2", "dc2"], 2),
    ({"class": SIMPLE, "replication_factor": "1"}, [None], 1),
    ({}, [], 1),
])
def test_datacenters_holding_replicas(replication: dict[str, str], hosts: list[str | None], datacenters: int) -> None:
    assert cql.replicated_datacenters(replication, hosts) == datacenters
