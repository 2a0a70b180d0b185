"""SASL DIGEST-MD5 for the installation identity, as pure rules: the settings it needs, the
ACLs it writes (`sasl:<user>`, namespaces still digest), what kazoo is given to log in, the
namespaces' Secret, and the local stack's ZooKeeper configuration for it."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from kazoo.security import ACL, Id, Permissions
from pydantic import SecretStr, ValidationError

from casque.backends import zk
from casque.backends.zkacl import NAMESPACE_PERMS, Identity, installation_policy, namespace_identity, parse_acl
from casque.config import Settings
from casque.devstack.stack import Stack, StackPorts
from casque.devstack.zookeeper import DIGEST_LOGIN_MODULE, SASL_PROVIDER
from casque.operator.tenancy import zookeeper_secret

PASSWORD = "s" * 40
PREVIOUS = "r" * 40
KEY = "k" * 40
SASL = Identity("casque", PASSWORD, "sasl")


def sasl_settings(**changes: object) -> Settings:
    return Settings(zookeeper_username="casque", zookeeper_password=SecretStr(PASSWORD), zookeeper_sasl=True,
                    derivation_key=SecretStr(KEY), **changes)  # type: ignore[arg-type]


def test_a_sasl_identitys_acl_entry_names_the_user_and_no_password() -> None:
    assert SASL.acl_id == Id("sasl", "casque")
    assert SASL.acl_id == Identity("casque", PREVIOUS, "sasl").acl_id  # a new password changes no entry
    assert SASL.sasl_options == {"mechanism": "DIGEST-MD5", "username": "casque", "password": PASSWORD}
    assert PASSWORD not in repr(SASL)
    with pytest.raises(ValueError):
        SASL.auth  # noqa: B018  # a SASL identity is no digest credential
    with pytest.raises(ValueError):
        Identity("casque", PASSWORD).sasl_options  # noqa: B018


def test_with_sasl_the_installation_is_sasl_and_each_namespace_digest_derived_from_the_key() -> None:
    policy = installation_policy("/casque", [SASL], [KEY])
    shop = namespace_identity("casque", KEY, "shop")
    # The same as with digest.
    assert installation_policy("/casque", [Identity("casque", PASSWORD)], [KEY]).acl_for("/casque/queues/shop")[1:] == [
        ACL(Permissions.READ, shop.acl_id)]
    admin = ACL(Permissions.ALL, Id("sasl", "casque"))
    assert policy.acl_for("/casque/queues") == [admin]
    assert policy.acl_for("/casque/queues/shop") == [admin, ACL(Permissions.READ, shop.acl_id)]
    assert policy.acl_for("/casque/queues/shop/orders/subscribers/b/members/m") == [
        admin, ACL(NAMESPACE_PERMS, shop.acl_id)]
    assert policy.acl_for("/casque/queues/shop/orders") == [admin, ACL(Permissions.READ, shop.acl_id)]
    assert shop.acl_id.scheme == "digest"


def test_during_a_sasl_rotation_the_installation_and_the_namespace_are_each_named_once() -> None:
    previous = Identity("casque", PREVIOUS, "sasl")
    acl = installation_policy("/casque", [SASL, previous], [KEY]).acl_for("/casque/queues/shop/orders")
    # The namespace's identity is derived from the key, which this rotation leaves alone.
    assert [entry.id for entry in acl] == [Id("sasl", "casque"), namespace_identity("casque", KEY, "shop").acl_id]


def test_the_settings_make_sasl_identities_and_kazoo_gets_one_sasl_login() -> None:
    rotating = sasl_settings(zookeeper_previous_password=SecretStr(PREVIOUS))
    own = zk.identities(rotating)
    assert [(i.scheme, i.password) for i in own] == [("sasl", PASSWORD), ("sasl", PREVIOUS)]
    # One login with the current password: the servers' JAAS file has one per user.
    assert zk.login_options(own) == {"sasl_options": {"mechanism": "DIGEST-MD5", "username": "casque",
                                                      "password": PASSWORD}}
    digest = zk.identities(Settings(zookeeper_username="casque", zookeeper_password=SecretStr(PASSWORD),
                                    derivation_key=SecretStr(KEY)))
    assert zk.login_options(digest) == {"auth_data": [("digest", f"casque:{PASSWORD}")]}
    assert zk.login_options([]) == {}
    assert PASSWORD not in repr(rotating)


@pytest.mark.parametrize("fields, message", [
    ({"zookeeper_sasl": True}, "CASQUE_ZOOKEEPER_SASL=true needs CASQUE_ZOOKEEPER_USERNAME and _PASSWORD"),
    ({"zookeeper_sasl": True, "zookeeper_username": "casque.shop", "zookeeper_password": PASSWORD,
      "zookeeper_acl": "digest:casque.shop:x:rwcd"}, "namespace's credentials .* log in with digest"),
    ({"zookeeper_sasl": True, "zookeeper_username": "casque", "zookeeper_password": "short"}, "at least 32"),
])
def test_settings_refuse_sasl_combinations_that_cannot_work(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**fields)  # type: ignore[arg-type]


def test_the_namespaces_secret_is_digest_and_its_acl_names_the_sasl_user() -> None:
    secret = zookeeper_secret(sasl_settings(), "shop")
    assert secret is not None
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    expected = namespace_identity("casque", KEY, "shop")
    assert (data["username"], data["password"]) == (expected.username, expected.password)
    assert parse_acl(data["acl"]) == [ACL(Permissions.ALL, Id("sasl", "casque")), ACL(NAMESPACE_PERMS, expected.acl_id)]
    assert data["acl"].startswith("sasl:casque:rwcda,digest:casque.shop:")
    # What a sidecar is given is valid for it: digest credentials with an ACL, no SASL.
    sidecar = Settings(zookeeper_username=data["username"], zookeeper_password=SecretStr(data["password"]),
                       zookeeper_acl=data["acl"])
    assert [i.scheme for i in zk.identities(sidecar)] == ["digest"]
    assert PASSWORD not in str(secret)


def test_the_local_stack_gives_zookeeper_a_private_jaas_file_and_the_sasl_provider(tmp_path: Path) -> None:
    stack = Stack(tmp_path, ports=StackPorts(zookeeper=12181), zookeeper_sasl=True)
    login = stack.zookeeper_sasl_login
    assert login is not None
    login.ensure()
    password = login.password()
    login.ensure()
    assert login.password() == password and len(password) >= 32  # kept across `up`s
    (server,) = stack.zookeeper().members()
    server.write_config()
    config = dict(line.split("=", 1) for line in (server.directory / "zoo.cfg").read_text().splitlines() if "=" in line)
    assert config["authProvider.sasl"] == SASL_PROVIDER
    jaas = server.jaas_path.read_text()
    assert jaas.startswith("Server {") and DIGEST_LOGIN_MODULE in jaas and f'user_casque="{password}";' in jaas
    assert password not in (server.directory / "zoo.cfg").read_text()
    for secret in (server.jaas_path, login.password_file):
        assert (secret.stat().st_mode & 0o777) == 0o600
    env = stack.client_env()
    assert (env["CASQUE_ZOOKEEPER_SASL"], env["CASQUE_ZOOKEEPER_USERNAME"], env["CASQUE_ZOOKEEPER_PASSWORD"]) == (
        "true", "casque", password)
    # What `dev up` prints is valid.
    Settings(zookeeper_username=env["CASQUE_ZOOKEEPER_USERNAME"], zookeeper_password=SecretStr(password),
             zookeeper_sasl=True, derivation_key=SecretStr(env["CASQUE_DERIVATION_KEY"]))
    assert env["CASQUE_DERIVATION_KEY"] == stack.client_env()["CASQUE_DERIVATION_KEY"]  # kept across `up`s
    assert ((tmp_path / "derivation.key").stat().st_mode & 0o777) == 0o600
    stack._save()
    assert Stack.load(tmp_path) == stack
    plain = Stack(tmp_path / "plain").zookeeper().members()[0]
    plain.write_config()
    assert "authProvider" not in (plain.directory / "zoo.cfg").read_text() and not plain.jaas_path.exists()
