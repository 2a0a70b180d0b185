import pytest

from casque.config import ReplicationSettings, Settings


def test_contact_points_from_comma_separated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASQUE_CASSANDRA_CONTACT_POINTS", "10.0.0.1, 10.0.0.2")
    assert Settings().cassandra_contact_points == ["10.0.0.1", "10.0.0.2"]


def test_replication_maps() -> None:
    assert ReplicationSettings().cql_map() == "{'class': 'SimpleStrategy', 'replication_factor': 1}"
    nts = ReplicationSettings(strategy="NetworkTopologyStrategy", datacenters={"dc2": 3, "dc1": 3})
    assert nts.cql_map() == "{'class': 'NetworkTopologyStrategy', 'dc1': 3, 'dc2': 3}"
    with pytest.raises(ValueError):
        ReplicationSettings(strategy="NetworkTopologyStrategy").cql_map()


def test_bad_keyspace_name_is_refused() -> None:
    with pytest.raises(ValueError):
        Settings(keyspace="Bad-Name")
