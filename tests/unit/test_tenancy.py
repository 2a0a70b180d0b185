"""The operator's per-namespace rules, pure: the namespace's Secrets, Cassandra keyspace and
role names, and quotas."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from types import SimpleNamespace
from typing import Any, cast

import pytest
from kubernetes.client.exceptions import ApiException
from pydantic import SecretStr

from casque.backends.zkacl import Identity, namespace_identity, parse_acl
from casque.config import Settings
from casque.derivation import CASSANDRA_ROLE, ZOOKEEPER_IDENTITY
from casque.errors import InvalidSpec
from casque.operator.quotas import MAX_LOGS, MAX_QUEUES, MAX_RETENTION, Limits, QuotaSettings, limits_for, violations
from casque.operator import tenancy
from casque.operator.tenancy import cassandra_secret, zookeeper_secret
from casque.schema import QueueRef, is_name
from casque.specs import QueueSpec
from casque.store import Store
from casque.tenancy import MAX_KEYSPACE_LENGTH, namespace_keyspace, namespace_role

PASSWORD = "i" * 40
KEY = "k" * 40


def spec(shards: int = 1, priorities: int = 1, retention: int = 3600) -> QueueSpec:
    return QueueSpec(shards=shards, priorities=priorities, retention_seconds=retention)


def test_no_secret_without_zookeeper_authentication() -> None:
    assert zookeeper_secret(Settings(), "shop") is None


def zookeeper_settings(password: str = PASSWORD, key: str = KEY, previous_key: str | None = None) -> Settings:
    return Settings(zookeeper_username="casque", zookeeper_password=SecretStr(password), derivation_key=SecretStr(key),
                    previous_derivation_key=SecretStr(previous_key) if previous_key else None)


def zookeeper_secret_data(settings: Settings, namespace: str) -> dict[str, str]:
    secret = zookeeper_secret(settings, namespace)
    assert secret is not None
    return {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}


def test_the_secret_holds_the_namespaces_identity_and_acl_never_the_installations() -> None:
    secret = zookeeper_secret(zookeeper_settings(), "shop")
    assert secret is not None and secret["metadata"]["namespace"] == "shop"
    data = zookeeper_secret_data(zookeeper_settings(), "shop")
    expected = namespace_identity("casque", KEY, "shop")
    assert (data["username"], data["password"]) == (expected.username, expected.password)
    assert {entry.id for entry in parse_acl(data["acl"])} == {Identity("casque", PASSWORD).acl_id, expected.acl_id}
    assert PASSWORD not in str(secret) and KEY not in str(secret)


def test_during_a_key_rotation_the_secret_holds_the_new_identity_and_an_acl_naming_both() -> None:
    data = zookeeper_secret_data(zookeeper_settings(key="r" * 40, previous_key=KEY), "shop")
    new, old = namespace_identity("casque", "r" * 40, "shop"), namespace_identity("casque", KEY, "shop")
    assert (data["username"], data["password"]) == (new.username, new.password)
    installation = Identity("casque", PASSWORD).acl_id
    assert [entry.id for entry in parse_acl(data["acl"])] == [installation, new.acl_id, old.acl_id]


def test_a_namespaces_zookeeper_secret_gives_no_way_to_another_namespaces_identity() -> None:
    """The guessed-derivation attack on ZooKeeper: a namespace holds its identity's password
    and knows its own name and the derivation scheme. Were the password an HMAC keyed with
    the installation's ZooKeeper password, it would confirm guesses of that password offline,
    and whoever knows that password (or guessed it) would compute every other namespace's
    password. Keyed with the derivation key, neither the installation password nor any guess
    of it reproduces a namespace's password, and the installation password is no input."""
    def keyed_with(login: str, namespace: str) -> str:
        digest = hmac.new(login.encode(), ZOOKEEPER_IDENTITY + namespace.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    settings = zookeeper_settings()
    stolen = zookeeper_secret_data(settings, "shop")["password"]
    other = zookeeper_secret_data(settings, "billing")["password"]
    for guess in ["casque", "zookeeper", "password", PASSWORD]:  # the real installation password last
        assert keyed_with(guess, "shop") != stolen, guess
        assert keyed_with(guess, "billing") != other, guess
    assert zookeeper_secret_data(zookeeper_settings(password="another-installation-password-0123456789"),
                                 "shop")["password"] == stolen
    assert zookeeper_secret_data(zookeeper_settings(key="r" * 40), "shop")["password"] != stolen
    # One key, two uses: the namespace's Cassandra password is not its ZooKeeper one.
    assert namespace_role("casque", KEY, "shop").password != stolen
    assert PASSWORD not in stolen and KEY not in stolen


class SecretsApi:
    """The CoreV1Api calls of the operator's Secret writes, on a dict, recording each write."""

    def __init__(self, events: list[str]) -> None:
        self.stored: dict[tuple[str, str], dict[str, str]] = {}
        self.events = events
        self.down = False  # the API server refuses writes, as if the operator stopped before them

    def read_namespaced_secret(self, name: str, namespace: str) -> SimpleNamespace:
        if (namespace, name) not in self.stored:
            raise ApiException(status=404)
        return SimpleNamespace(data=self.stored[(namespace, name)])

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        if (namespace, body["metadata"]["name"]) in self.stored:
            raise ApiException(status=409)
        self.events.append("write")
        self.stored[(namespace, body["metadata"]["name"])] = body["data"]

    def patch_namespaced_secret(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        if self.down:
            raise ApiException(status=503)
        self.events.append("write")
        self.stored[(namespace, name)] = body["data"]


def test_the_namespaces_znodes_are_secured_before_its_secret_names_a_new_identity(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    secrets_api = SecretsApi(events)
    monkeypatch.setattr(tenancy.client, "CoreV1Api", lambda api: secrets_api)

    def apply(settings: Settings) -> bool:
        return tenancy.apply_zookeeper_secret(cast(Any, None), settings, "shop", lambda: events.append("secure"))

    assert apply(zookeeper_settings()) and events == ["secure", "write"]
    assert not apply(zookeeper_settings()) and events == ["secure", "write"]  # up to date: nothing to do
    assert apply(zookeeper_settings(key="r" * 40)) and events == ["secure", "write"] * 2
    stored = secrets_api.stored[("shop", "casque-zookeeper")]
    assert base64.b64decode(stored["password"]).decode() == namespace_identity("casque", "r" * 40, "shop").password
    # A write that did not happen after the walk: the next reconcile walks again, then writes.
    events.clear()
    secrets_api.down = True
    with pytest.raises(ApiException):
        apply(zookeeper_settings(key="s" * 40))
    secrets_api.down = False
    assert apply(zookeeper_settings(key="s" * 40)) and events == ["secure", "secure", "write"]


# Cassandra's own rule for keyspace names (unquoted, as casque writes them).
KEYSPACE_NAME = re.compile(rf"^[a-z][a-z0-9_]{{0,{MAX_KEYSPACE_LENGTH - 1}}}$")


def test_a_namespaces_keyspace_is_the_installations_with_the_namespace_readable() -> None:
    assert namespace_keyspace("casque", "team-a") == "casque_team_a"
    assert namespace_keyspace("casque", "team-a") == namespace_keyspace("casque", "team-a")
    assert namespace_keyspace("other", "team-a") == "other_team_a"


@pytest.mark.parametrize("installation", ["casque", "c", "x" * 24])
def test_keyspace_names_are_valid_and_distinct_for_any_namespaces(installation: str) -> None:
    longest = "n" * 63
    names = ["a", "a-b", "a--b", "ab", "team-1", longest, longest[:-1] + "m", "a" * 40, "a" * 41,
             # A short namespace that ends like a long one's hash cannot take its keyspace.
             namespace_keyspace(installation, longest)[len(installation) + 1:].replace("_", "-")]
    keyspaces = [namespace_keyspace(installation, name) for name in names if is_name(name)]
    assert all(KEYSPACE_NAME.match(keyspace) for keyspace in keyspaces), keyspaces
    assert len(set(keyspaces)) == len(keyspaces), keyspaces
    assert namespace_keyspace(installation, longest).startswith(f"{installation}_nnn")


def test_a_namespace_keyspace_refuses_what_cassandra_could_not_name() -> None:
    with pytest.raises(InvalidSpec, match="at most 24|longer than 24"):
        namespace_keyspace("k" * 25, "shop")
    with pytest.raises(InvalidSpec, match="DNS label"):
        namespace_keyspace("casque", "Shop_1")
    with pytest.raises(ValueError, match="at most 24"):
        Settings(cassandra_isolation="keyspace", keyspace="k" * 25, cassandra_username="casque",
                 cassandra_password=SecretStr("p" * 40), derivation_key=SecretStr(KEY))
    with pytest.raises(ValueError, match="needs CASQUE_CASSANDRA_USERNAME and _PASSWORD"):
        Settings(cassandra_isolation="keyspace")


def isolated(password: str = PASSWORD, key: str = KEY) -> Settings:
    return Settings(cassandra_isolation="keyspace", cassandra_username="cassandra",
                    cassandra_password=SecretStr(password), derivation_key=SecretStr(key))


def test_isolation_refuses_to_start_without_a_long_derivation_key() -> None:
    with pytest.raises(ValueError, match="needs CASQUE_DERIVATION_KEY, a random key of at least 32 bytes"):
        Settings(cassandra_isolation="keyspace", cassandra_username="casque", cassandra_password=SecretStr(PASSWORD))
    with pytest.raises(ValueError, match="CASQUE_DERIVATION_KEY must be a random key of at least 32 bytes"):
        isolated(key="k" * 31)
    with pytest.raises(InvalidSpec, match="at least 32 bytes"):
        namespace_role("casque", "k" * 31, "shop")
    assert isolated(key="k" * 32).derivation_key is not None


def test_a_namespaces_role_password_is_derived_from_the_key_and_differs_per_namespace() -> None:
    shop = namespace_role("casque", KEY, "shop")
    assert shop == namespace_role("casque", KEY, "shop")  # the operator recomputes it
    assert shop.username == shop.keyspace == "casque_shop"
    assert shop.password != namespace_role("casque", KEY, "shoe").password
    assert shop.password != namespace_role("casque", "j" * 40, "shop").password  # rotates with the key
    assert len(shop.password) >= 40 and KEY not in shop.password
    assert shop.password not in repr(shop)


def test_a_namespaces_secret_says_nothing_of_the_installations_login_password() -> None:
    """The guessed-derivation attack: a namespace holds its role's password and knows its own
    name and the derivation scheme. Were the password an HMAC keyed with the installation's
    login password, trying candidate login passwords offline would confirm the right one
    (`cassandra` fell in 6 guesses). It is keyed with the derivation key instead, so no
    candidate login password reproduces it, the right one included, and the login password
    is no input at all: changing it leaves every namespace's password as it was."""
    def secret_password(settings: Settings) -> str:
        secret = cassandra_secret(settings, "shop")
        assert secret is not None
        return base64.b64decode(secret["data"]["password"]).decode()

    login = "cassandra-installation-login"
    stolen = secret_password(isolated(password=login))
    for guess in ["cassandra", "casque", "password", login]:
        digest = hmac.new(guess.encode(), CASSANDRA_ROLE + b"shop", hashlib.sha256).digest()
        assert base64.urlsafe_b64encode(digest).decode().rstrip("=") != stolen, guess
    assert secret_password(isolated(password="another-login-password")) == stolen
    assert secret_password(isolated(password=login, key="r" * 40)) != stolen
    assert login not in stolen and KEY not in stolen


def test_the_cassandra_secret_holds_the_namespaces_role_and_keyspace_never_the_installations() -> None:
    assert cassandra_secret(Settings(), "shop") is None
    secret = cassandra_secret(isolated(), "shop")
    assert secret is not None and secret["metadata"] == {
        "name": "casque-cassandra-role", "namespace": "shop", "labels": {"app.kubernetes.io/managed-by": "casque-operator"}}
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    role = namespace_role("casque", KEY, "shop")
    assert data == {"username": role.username, "password": role.password, "keyspace": role.keyspace}
    assert PASSWORD not in str(secret) and KEY not in str(secret)


def test_queue_count_limit_counts_new_queues_only() -> None:
    limits = Limits(max_queues=2)
    assert violations(limits, [spec()], None, spec()) == []
    [problem] = violations(limits, [spec(), spec()], None, spec())
    assert "2 queues and has 2 already" in problem
    assert violations(limits, [spec(), spec()], spec(), spec(shards=2)) == []  # an update is not a new queue


def test_shard_priority_limit_sums_the_namespace() -> None:
    limits = Limits(max_shard_priorities=10)
    assert violations(limits, [spec(shards=4)], None, spec(shards=3, priorities=2)) == []
    [problem] = violations(limits, [spec(shards=4)], None, spec(shards=4, priorities=2))
    assert "would reach 12" in problem and "limit is 10" in problem


def test_lowering_a_limit_never_refuses_what_does_not_grow() -> None:
    limits = Limits(max_shard_priorities=2, max_retention_seconds=60)
    running = spec(shards=8, retention=86400)
    assert violations(limits, [], running, spec(shards=8, retention=3600)) == []
    problems = violations(limits, [], running, spec(shards=9, retention=2 * 86400))
    assert len(problems) == 2 and "retention 2d is longer than the namespace's limit of 1m" in problems[1]


def test_namespace_annotations_override_the_defaults() -> None:
    defaults = QuotaSettings(max_queues=5, max_shard_priorities=20, max_retention="7d")
    assert limits_for(defaults, None) == Limits(5, 20, 7 * 86400)
    assert limits_for(defaults, {MAX_QUEUES: "50", MAX_LOGS: "", MAX_RETENTION: "30d"}) == Limits(50, None, 30 * 86400)
    for bad in ({MAX_QUEUES: "many"}, {MAX_RETENTION: "forever"}):
        with pytest.raises(InvalidSpec):
            limits_for(defaults, bad)


def _store(isolation: bool) -> Store:
    # No connections: only the naming is under test.
    return Store(session=cast(Any, None), zk=cast(Any, None), keyspace="casque", zk_root="/casque",
                 replication_cql="", isolation=isolation)


def test_an_isolated_store_finds_each_queue_in_its_namespaces_keyspace() -> None:
    store = _store(isolation=True)
    orders = QueueRef("team-a", "orders")
    assert store.table(orders) == f"casque_team_a.{orders.messages_table}"
    assert store.keyspace_of("team-b") == "casque_team_b"
    view = store.for_namespace("team-a")
    assert (view.keyspace, view.isolation, view.table(orders)) == ("casque_team_a", False, store.table(orders))
    assert view.namespace_view_keyspace("counters") == "casque_team_a"
    # Code that knows a queue only by its shared-table key must be handed a namespace's view.
    with pytest.raises(RuntimeError, match="for_namespace"):
        store.namespace_view_keyspace("counters")


def test_without_isolation_every_namespace_uses_the_installation_keyspace() -> None:
    store = _store(isolation=False)
    assert store.keyspace_of("team-a") == store.keyspace_of("team-b") == "casque"
    assert store.for_namespace("team-a") is store
    assert store.table(QueueRef("team-a", "orders")).startswith("casque.m_orders_")
