"""The pure parts of replacing Cassandra's default superuser (casque/backends/superuser.py);
tests/integration/test_images.py runs the whole of it on the casque-cassandra image."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from casque.backends.superuser import (
    missing_nodes,
    quote_identifier,
    replication_differs,
    secure_cassandra,
    wanted_replication,
)
from casque.config import ReplicationSettings, Settings
from casque.errors import InvalidSettings


def test_system_auth_gets_the_installation_keyspaces_replication() -> None:
    assert wanted_replication(ReplicationSettings(strategy="NetworkTopologyStrategy", datacenters={"dc1": 3})) == {
        "class": "org.apache.cassandra.locator.NetworkTopologyStrategy", "dc1": "3"}
    assert wanted_replication(ReplicationSettings(strategy="SimpleStrategy", factor=1)) == {
        "class": "org.apache.cassandra.locator.SimpleStrategy", "replication_factor": "1"}
    with pytest.raises(InvalidSettings, match="CASQUE_REPLICATION_DATACENTERS"):
        wanted_replication(ReplicationSettings(strategy="NetworkTopologyStrategy"))


def test_a_replication_is_the_same_whether_its_class_names_its_package_or_not() -> None:
    wanted = {"class": "org.apache.cassandra.locator.NetworkTopologyStrategy", "dc1": "1"}
    assert not replication_differs({"class": "NetworkTopologyStrategy", "dc1": "1"}, wanted)
    # Cassandra's own default for system_auth: one replica, placed without datacenters.
    assert replication_differs({"class": "org.apache.cassandra.locator.SimpleStrategy", "replication_factor": "1"},
                               wanted)
    assert replication_differs({"class": "NetworkTopologyStrategy", "dc1": "3"}, wanted)


def test_the_replication_waits_for_as_many_nodes_up_as_replicas() -> None:
    three = {"class": "org.apache.cassandra.locator.NetworkTopologyStrategy", "dc1": "3"}
    assert missing_nodes(three, {"dc1": 1}) == "3 nodes up in datacenter dc1, 1 are"
    assert missing_nodes(three, {"dc2": 3}) == "3 nodes up in datacenter dc1, 0 are"
    assert missing_nodes(three, {"dc1": 3}) is None
    simple = {"class": "SimpleStrategy", "replication_factor": "2"}
    assert missing_nodes(simple, {"dc1": 1}) == "2 nodes up, 1 are"
    assert missing_nodes(simple, {"dc1": 1, "dc2": 1}) is None


def test_a_role_name_is_quoted_as_it_is() -> None:
    assert quote_identifier("casque") == '"casque"'
    assert quote_identifier('a"b; DROP ROLE x') == '"a""b; DROP ROLE x"'


def test_without_an_installation_login_or_with_the_default_ones_name_it_refuses_before_connecting() -> None:
    with pytest.raises(InvalidSettings, match="needs CASQUE_CASSANDRA_USERNAME and CASQUE_CASSANDRA_PASSWORD"):
        secure_cassandra(Settings(cassandra_contact_points=["192.0.2.1"]))
    with pytest.raises(InvalidSettings, match="must not be 'cassandra'"):
        secure_cassandra(Settings(cassandra_contact_points=["192.0.2.1"], cassandra_username="cassandra",
                                  cassandra_password=SecretStr("p" * 32)))
