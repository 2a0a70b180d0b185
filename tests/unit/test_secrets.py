"""Credentials stay out of reprs, dumps, log lines and error messages."""

from __future__ import annotations

import logging

import pytest

from casque.backends import cql, zk
from casque.config import Settings
from casque.errors import CasqueError
from tests.fixtures.waiting import refused_port

CASSANDRA_PASSWORD = "cassandra-password-that-must-not-leak"
ZOOKEEPER_PASSWORD = "zookeeper-password-that-must-not-leak-0123456789"
DERIVATION_KEY = "derivation-key-that-must-not-leak-0123456789"


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("CASQUE_CASSANDRA_USERNAME", "app")
    monkeypatch.setenv("CASQUE_CASSANDRA_PASSWORD", CASSANDRA_PASSWORD)
    monkeypatch.setenv("CASQUE_ZOOKEEPER_USERNAME", "app")
    monkeypatch.setenv("CASQUE_ZOOKEEPER_PASSWORD", ZOOKEEPER_PASSWORD)
    monkeypatch.setenv("CASQUE_DERIVATION_KEY", DERIVATION_KEY)
    return Settings()


def leaks(text: str) -> bool:
    return CASSANDRA_PASSWORD in text or ZOOKEEPER_PASSWORD in text or DERIVATION_KEY in text


def test_settings_never_show_the_passwords(settings: Settings) -> None:
    assert settings.cassandra_password is not None
    assert settings.cassandra_password.get_secret_value() == CASSANDRA_PASSWORD
    for shown in (repr(settings), str(settings), settings.model_dump_json(), str(settings.model_dump())):
        assert not leaks(shown), shown


def test_failed_connections_log_and_raise_without_the_passwords(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    # Nothing listens on these ports: both connections fail at once.
    with refused_port() as cassandra_port, refused_port() as zookeeper_port:
        unreachable = settings.model_copy(update={
            "cassandra_contact_points": ["127.0.0.1"], "cassandra_port": cassandra_port,
            "zookeeper_hosts": f"127.0.0.1:{zookeeper_port}",
        })
        with pytest.raises(CasqueError) as cassandra:
            cql.connect(unreachable)
        with pytest.raises(CasqueError) as zookeeper:
            zk.connect(unreachable, timeout=1.0)
    for error in (cassandra.value, zookeeper.value):
        assert not leaks(str(error)) and not leaks(repr(error)) and not leaks(repr(error.__cause__))
    assert caplog.records, "the drivers logged nothing: this test would not see a leak"
    assert not any(leaks(record.getMessage()) for record in caplog.records)
