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


def test_tls_is_off_unless_enabled_and_checks_hostnames_when_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Settings().cassandra_tls.enabled and not Settings().zookeeper_tls.enabled
    monkeypatch.setenv("CASQUE_CASSANDRA_TLS_ENABLED", "true")
    monkeypatch.setenv("CASQUE_CASSANDRA_TLS_CA_FILE", "/etc/casque/cassandra/ca.crt")
    monkeypatch.setenv("CASQUE_ZOOKEEPER_TLS_ENABLED", "true")
    settings = Settings()
    assert settings.cassandra_tls.enabled and settings.cassandra_tls.verify_hostname
    assert str(settings.cassandra_tls.ca_file) == "/etc/casque/cassandra/ca.crt"
    assert settings.zookeeper_tls.enabled and settings.zookeeper_tls.verify_hostname
    assert settings.zookeeper_tls.ca_file is None  # the system's CAs


def test_tls_files_without_tls_or_a_certificate_without_its_key_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASQUE_ZOOKEEPER_TLS_CA_FILE", "/ca.crt")
    with pytest.raises(ValueError, match="CASQUE_ZOOKEEPER_TLS_ENABLED"):
        Settings()
    monkeypatch.setenv("CASQUE_ZOOKEEPER_TLS_ENABLED", "true")
    monkeypatch.setenv("CASQUE_ZOOKEEPER_TLS_CERT_FILE", "/client.crt")
    with pytest.raises(ValueError, match="CASQUE_ZOOKEEPER_TLS_KEY_FILE"):
        Settings()


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("CASQUE_CASSANDRA_PASSWORD", "cassandra", "CASQUE_CASSANDRA_PASSWORD must be at least 16 characters"),
        ("CASQUE_ZOOKEEPER_PASSWORD", "z" * 31, "CASQUE_ZOOKEEPER_PASSWORD must be at least 32 characters"),
        ("CASQUE_DERIVATION_KEY", "k" * 31, "CASQUE_DERIVATION_KEY must be a random key of at least 32 bytes"),
        ("CASQUE_PREVIOUS_DERIVATION_KEY", "k" * 31,
         "CASQUE_PREVIOUS_DERIVATION_KEY must be a random key of at least 32 bytes"),
    ],
)
def test_every_configured_secret_has_a_minimum_length(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, error: str
) -> None:
    """Refused when the process starts, naming the variable, and never echoing the value."""
    monkeypatch.setenv("CASQUE_CASSANDRA_USERNAME", "casque")
    monkeypatch.setenv("CASQUE_ZOOKEEPER_USERNAME", "casque")
    monkeypatch.setenv("CASQUE_CASSANDRA_PASSWORD", "c" * 16)
    monkeypatch.setenv("CASQUE_ZOOKEEPER_PASSWORD", "z" * 32)
    monkeypatch.setenv("CASQUE_DERIVATION_KEY", "d" * 32)
    monkeypatch.setenv("CASQUE_PREVIOUS_DERIVATION_KEY", "e" * 32)
    Settings()  # long enough, all of them
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=error) as refused:
        Settings()
    assert value not in str(refused.value).replace(variable, "")
