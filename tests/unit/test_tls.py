"""Client TLS settings turned into the drivers' arguments."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from casque.backends import cql, zk
from casque.backends.tls import client_context
from casque.config import CassandraTlsSettings, Settings, ZooKeeperTlsSettings
from casque.devstack.pki import issue_cert, make_ca
from casque.errors import InvalidSettings


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca, ca_key = make_ca(tmp_path)
    crt, key = issue_cert(tmp_path, ca, ca_key, "client", client=True)
    return {"ca_file": ca, "cert_file": crt, "key_file": key}


def test_tls_off_gives_the_drivers_nothing() -> None:
    assert cql.tls_options(Settings()) == {} and zk.tls_options(Settings()) == {}


def test_cassandra_checks_each_nodes_address_or_one_given_name(pki: dict[str, Path]) -> None:
    tls = CassandraTlsSettings(enabled=True, **pki)
    options = cql.tls_options(Settings(cassandra_tls=tls))
    context = options["ssl_context"]
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    # Without a name the driver checks each node against its own address.
    assert "ssl_options" not in options
    named = cql.tls_options(Settings(cassandra_tls=tls.model_copy(update={"server_hostname": "cassandra.db.svc"})))
    assert named["ssl_options"] == {"server_hostname": "cassandra.db.svc"}
    unchecked = cql.tls_options(Settings(cassandra_tls=tls.model_copy(update={"verify_hostname": False})))
    assert not unchecked["ssl_context"].check_hostname
    assert unchecked["ssl_context"].verify_mode == ssl.CERT_REQUIRED  # the chain is still checked


def test_zookeeper_gets_kazoos_tls_arguments(pki: dict[str, Path]) -> None:
    options = zk.tls_options(Settings(zookeeper_tls=ZooKeeperTlsSettings(enabled=True, **pki)))
    assert options == {"use_ssl": True, "ca": str(pki["ca_file"]), "certfile": str(pki["cert_file"]),
                       "keyfile": str(pki["key_file"]), "verify_certs": True, "check_hostname": True}


def test_a_missing_or_wrong_file_is_a_settings_error_that_names_it(pki: dict[str, Path], tmp_path: Path) -> None:
    missing = CassandraTlsSettings(enabled=True, ca_file=tmp_path / "nowhere.crt")
    with pytest.raises(InvalidSettings, match="nowhere.crt"):
        client_context(missing, "Cassandra")
    swapped = ZooKeeperTlsSettings(enabled=True, ca_file=pki["ca_file"], cert_file=pki["key_file"],
                                   key_file=pki["cert_file"])
    with pytest.raises(InvalidSettings, match="ZooKeeper TLS files"):
        zk.tls_options(Settings(zookeeper_tls=swapped))
