"""The local stack's TLS layout, without starting a server: the certificates it makes once,
Cassandra's client encryption, ZooKeeper's secure port, and what `stack.json` records."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from casque.cli.main import app
from casque.config import MIN_CASSANDRA_PASSWORD, Settings
from casque.devstack.stack import Stack, StackPorts
from casque.devstack.zookeeper import ZooKeeperEnsemble
from casque.errors import StackError


@pytest.fixture
def stack(tmp_path: Path) -> Stack:
    secure = Stack(tmp_path, ports=StackPorts(native=19042, zookeeper=12181), tls=True, client_auth=True,
                   password_auth=True)
    pki = secure.pki
    assert pki is not None
    pki.ensure(secure.contact_points)
    return secure


def test_the_certificates_are_made_once_and_name_the_nodes(stack: Stack) -> None:
    pki = stack.pki
    assert pki is not None
    before = pki.server_crt.read_bytes()
    pki.ensure(stack.contact_points)
    assert pki.server_crt.read_bytes() == before  # a second `up` reuses them
    names = subprocess.run(["openssl", "x509", "-in", str(pki.server_crt), "-noout", "-ext", "subjectAltName"],
                           capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in names and "DNS:localhost" in names
    assert (pki.password_file.stat().st_mode & 0o777) == 0o600
    pki.client_context()  # the client certificate and key belong together


def test_cassandra_serves_cql_over_tls_only_with_client_certificates_and_passwords(stack: Stack) -> None:
    (node,) = stack.cassandra_nodes()
    config = yaml.safe_load(node.render_yaml())
    encryption = config["client_encryption_options"]
    assert encryption["enabled"] is True and encryption["optional"] is False
    assert encryption["require_client_auth"] is True and encryption["store_type"] == "PKCS12"
    assert Path(encryption["keystore"]).exists() and Path(encryption["truststore"]).exists()
    assert config["authenticator"] == "PasswordAuthenticator"
    # A ring's nodes talk over TLS too, each presenting its certificate to the others.
    internode = config["server_encryption_options"]
    assert internode["internode_encryption"] == "all" and internode["require_client_auth"] is True
    assert (internode["keystore"], internode["truststore"]) == (encryption["keystore"], encryption["truststore"])
    plain = yaml.safe_load(Stack(stack.root).cassandra_nodes()[0].render_yaml())
    assert "client_encryption_options" not in plain and plain["authenticator"] == "AllowAllAuthenticator"
    assert "server_encryption_options" not in plain


def test_zookeeper_adds_a_tls_port_next_to_its_plaintext_one(stack: Stack) -> None:
    (server,) = stack.zookeeper().members()
    assert server.ports() == [(12181, "ZooKeeper client"), (12281, "ZooKeeper TLS client")]
    assert stack.zookeeper_tls_hosts == "127.0.0.1:12281"
    server.write_config()
    config = dict(line.split("=", 1) for line in (server.directory / "zoo.cfg").read_text().splitlines() if "=" in line)
    assert config["secureClientPort"] == "12281" and config["ssl.clientAuth"] == "need"
    assert config["serverCnxnFactory"] == "org.apache.zookeeper.server.NettyServerCnxnFactory"
    # The stores' password is read from a file, never written into the configuration.
    assert config["ssl.keyStore.passwordPath"] == str(stack.pki.password_file.resolve())  # type: ignore[union-attr]
    assert stack.pki.stores.password not in (server.directory / "zoo.cfg").read_text()  # type: ignore[union-attr]
    with pytest.raises(StackError, match="standalone"):
        ZooKeeperEnsemble(stack.root, size=3, pki=stack.pki).members()


def test_the_stack_records_its_security_and_its_clients_settings(stack: Stack) -> None:
    stack._save()
    assert Stack.load(stack.root) == stack
    env = stack.client_env()
    assert env["CASQUE_ZOOKEEPER_HOSTS"] == "127.0.0.1:12281"
    assert env["CASQUE_CASSANDRA_TLS_CERT_FILE"] == env["CASQUE_ZOOKEEPER_TLS_CERT_FILE"]
    # Not the default superuser, whose password is too short for casque: a role of the stack's
    # own with a random password, kept for the stack's life.
    assert env["CASQUE_CASSANDRA_USERNAME"] == "casque"
    assert len(env["CASQUE_CASSANDRA_PASSWORD"]) >= MIN_CASSANDRA_PASSWORD
    assert stack.client_env()["CASQUE_CASSANDRA_PASSWORD"] == env["CASQUE_CASSANDRA_PASSWORD"]
    plain = Stack(stack.root / "plain")
    assert not any("TLS" in name or "USERNAME" in name for name in plain.client_env())


def test_dev_up_refuses_tls_options_it_cannot_honour_before_starting_anything(tmp_path: Path) -> None:
    runner = CliRunner()
    for args, words in ((["--tls-client-auth"], "--tls-client-auth needs --tls"),
                        (["--tls", "--zookeeper-nodes", "3"], "standalone ZooKeeper")):
        result = runner.invoke(app, ["dev", "up", "--state-dir", str(tmp_path), *args])
        assert result.exit_code != 0 and words in result.output + result.stderr, (args, result.output)
    assert not (tmp_path / "stack.json").exists()


def test_a_secure_stack_gives_clients_the_settings_of_a_default_install(tmp_path: Path) -> None:
    """`dev up --secure`: TLS, logins, ZooKeeper identities and a keyspace per namespace, as
    the chart's defaults; the settings it prints are accepted as they are."""
    stack = Stack(tmp_path, ports=StackPorts(native=19042, zookeeper=12181), tls=True, password_auth=True,
                  zookeeper_sasl=True, isolation=True)
    stack._save()
    assert Stack.load(tmp_path) == stack
    stack.zookeeper_sasl_login.ensure()  # type: ignore[union-attr]  # `up` makes it
    env = stack.client_env()
    assert env["CASQUE_CASSANDRA_ISOLATION"] == "keyspace"
    assert env["CASQUE_DERIVATION_KEY"] == stack.derivation_key()
    settings = Settings(**{name.removeprefix("CASQUE_").lower(): value for name, value in env.items()
                           if not name.startswith(("CASQUE_CASSANDRA_TLS_", "CASQUE_ZOOKEEPER_TLS_"))})
    assert settings.cassandra_isolation == "keyspace" and settings.zookeeper_sasl
    assert "CASQUE_CASSANDRA_ISOLATION" not in Stack(tmp_path / "other", password_auth=True).client_env()


def test_dev_up_secure_refuses_to_turn_off_what_it_turns_on_before_starting_anything(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["dev", "up", "--state-dir", str(tmp_path), "--secure", "--no-tls"])
    assert result.exit_code != 0 and "--secure turns on what --no-tls turns off" in result.output + result.stderr
    assert not (tmp_path / "stack.json").exists()
    # A stack recorded as secure keeps it.
    Stack(tmp_path, tls=True, password_auth=True, zookeeper_sasl=True, isolation=True)._save()
    result = runner.invoke(app, ["dev", "up", "--state-dir", str(tmp_path), "--no-auth"])
    assert result.exit_code != 0 and "this stack runs --secure" in result.output + result.stderr
