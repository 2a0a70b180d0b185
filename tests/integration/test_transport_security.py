"""TLS and passwords on a real stack: Cassandra with client encryption and PasswordAuthenticator,
ZooKeeper on a TLS port with digest ACLs, both requiring client certificates (the
`secure_stack` fixture).

Every test has a keyspace and a ZooKeeper chroot of its own, reached over TLS.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cassandra.cluster import Cluster, Session
from aiohttp.test_utils import TestClient
from pydantic import SecretStr

from casque.backends import cql, zk
from casque.backends.zkacl import Identity, format_acl, installation_policy, namespace_identity
from casque.config import CassandraTlsSettings, Settings, ZooKeeperTlsSettings
from casque.devstack.pki import make_ca
from casque.devstack.stack import Stack
from casque.engine import catalog
from casque.engine.catalog import ensure_installation
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import AccessDenied, BackendUnavailable, TlsRefused
from casque.schema import QueueRef
from casque.sidecar.app import create_app
from casque.sidecar.config import SidecarSettings
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.proxy import Proxy
from tests.fixtures.stack import chroot_on, drop_keyspace, login_for_clean_up
from tests.fixtures.waiting import wait_for

QUEUE = QueueRef("default", "payments")
SUBSCRIBER = "ledger"
Client = TestClient[web.Request, web.Application]


def secure_settings(stack: Stack, keyspace: str, zk_hosts: str, **changes: Any) -> Settings:
    """The settings `casque dev up --tls --tls-client-auth --auth` prints, for one test."""
    pki = stack.pki
    assert pki is not None
    files = {"enabled": True, "ca_file": pki.ca_crt, "cert_file": pki.client_crt, "key_file": pki.client_key}
    cassandra_login = stack.cassandra_login
    assert cassandra_login is not None
    settings = Settings(
        cassandra_contact_points=stack.contact_points, cassandra_port=stack.ports.native,
        cassandra_username=cassandra_login.username, cassandra_password=SecretStr(cassandra_login.password()),
        cassandra_tls=CassandraTlsSettings(**files), zookeeper_tls=ZooKeeperTlsSettings(**files),
        zookeeper_hosts=zk_hosts, keyspace=keyspace, consistency="ONE",
        # A refused handshake shows as a start that times out: not worth 10 s per test.
        zookeeper_session_timeout_seconds=2,
    )
    return settings.model_copy(update=changes)


@pytest.fixture
def secure_zk_hosts(secure_stack: Stack) -> Iterator[str]:
    """The TLS connect string with a chroot of its own."""
    hosts = secure_stack.zookeeper_tls_hosts
    assert hosts is not None
    with chroot_on(hosts, **secure_stack.zookeeper_client_options()) as chrooted:
        yield chrooted


@pytest.fixture
def settings(secure_stack: Stack, secure_zk_hosts: str) -> Iterator[Settings]:
    keyspace = f"t_{uuid.uuid4().hex[:16]}"
    yield secure_settings(secure_stack, keyspace, secure_zk_hosts)
    admin = login_for_clean_up(secure_settings(secure_stack, keyspace, secure_zk_hosts))
    try:
        drop_keyspace(admin.session, keyspace)
    finally:
        admin.close()


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    opened = Store.open(settings)
    ensure_installation(opened)
    catalog.apply_queue(opened, QUEUE, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(opened, QUEUE, SUBSCRIBER, SubscriberSpec(queue=QUEUE.name, start_position="earliest"))
    try:
        yield opened
    finally:
        opened.close()


def refusal(settings: Settings) -> Exception:
    """What opening a Store with `settings` raises (the test fails if it connects)."""
    try:
        Store.open(settings).close()
    except (TlsRefused, BackendUnavailable, AccessDenied) as error:
        return error
    pytest.fail("connected with settings the stack must refuse")


def login_refused(settings: Settings) -> bool:
    """Whether Cassandra refuses a new login with `settings` now (it keeps a login it has
    checked for a moment, so a changed password takes effect soon, not at once)."""
    try:
        cluster, _ = cql.connect(settings)
    except AccessDenied:
        return True
    except BackendUnavailable:  # some of its connections were let in and some refused
        return False
    cluster.shutdown()
    return False


def connected(settings: Settings) -> tuple[Cluster, Session] | None:
    """A cluster and session, or None while the node does not answer in time (a loaded
    machine can take longer than the driver's connect timeout for a TLS login)."""
    try:
        return cql.connect(settings)
    except BackendUnavailable:
        return None


def without(tls: CassandraTlsSettings | ZooKeeperTlsSettings, **update: Any) -> Any:
    return tls.model_copy(update=update)


async def test_the_engine_publishes_and_consumes_over_tls_with_a_password(store: Store) -> None:
    # The connections really are encrypted, and authenticated as the superuser.
    (host,) = store.session.cluster.metadata.all_hosts()
    pool = store.session.get_pool_state()[host]
    assert pool["open_count"] >= 1
    assert store.session.cluster.ssl_context is not None
    assert store.zk.use_ssl
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    results = await asyncio.gather(*(publisher.publish([OutgoingMessage(f"m{i}".encode(), key=f"k{i}")])
                                     for i in range(20)))
    await publisher.flush_heads()
    published = {r[0].message_id for r in results}
    consumer = Consumer(store, QUEUE, SUBSCRIBER)
    await consumer.start()
    try:
        got: set[str] = set()
        deadline = time.monotonic() + 60
        while got != published and time.monotonic() < deadline:
            batch = await consumer.receive(max_messages=50, wait=1.0)
            await asyncio.gather(*(consumer.ack(d.receipt) for d in batch))
            got |= {d.message.message_id for d in batch}
    finally:
        await consumer.stop()
    assert got == published


@pytest.mark.parametrize("ca", ["system", "another"])
def test_a_client_that_does_not_trust_the_stacks_ca_is_refused_clearly(
    settings: Settings, tmp_path: Path, ca: str
) -> None:
    ca_file = None if ca == "system" else make_ca(tmp_path, "another-ca")[0]
    cassandra = refusal(settings.model_copy(update={"cassandra_tls": without(settings.cassandra_tls, ca_file=ca_file)}))
    assert isinstance(cassandra, TlsRefused) and "certificate was not accepted" in str(cassandra), cassandra
    zookeeper = refusal(settings.model_copy(update={"zookeeper_tls": without(settings.zookeeper_tls, ca_file=ca_file)}))
    assert isinstance(zookeeper, TlsRefused) and "certificate was not accepted" in str(zookeeper), zookeeper


def test_a_client_without_a_certificate_is_refused_where_one_is_required(settings: Settings) -> None:
    no_cert = {"cert_file": None, "key_file": None}
    cassandra = refusal(settings.model_copy(update={"cassandra_tls": without(settings.cassandra_tls, **no_cert)}))
    assert isinstance(cassandra, TlsRefused) and "client certificate" in str(cassandra), cassandra
    zookeeper = refusal(settings.model_copy(update={"zookeeper_tls": without(settings.zookeeper_tls, **no_cert)}))
    assert isinstance(zookeeper, TlsRefused) and "client certificate" in str(zookeeper), zookeeper


def test_a_server_certificate_for_another_name_is_refused(settings: Settings) -> None:
    # The stack's certificate names 127.0.0.1 and localhost.
    renamed = without(settings.cassandra_tls, server_hostname="cassandra.elsewhere.example")
    error = refusal(settings.model_copy(update={"cassandra_tls": renamed}))
    assert isinstance(error, TlsRefused) and "mismatch" in str(error).lower(), error
    # ...and the check is what refuses it.
    unchecked = without(renamed, verify_hostname=False)
    Store.open(settings.model_copy(update={"cassandra_tls": unchecked})).close()
    # "127.1" is 127.0.0.1 to the resolver, but not a name the certificate carries.
    elsewhere = settings.zookeeper_hosts.replace("127.0.0.1:", "127.1:")
    error = refusal(settings.model_copy(update={"zookeeper_hosts": elsewhere}))
    assert isinstance(error, TlsRefused) and "mismatch" in str(error).lower(), error
    Store.open(settings.model_copy(update={"zookeeper_hosts": elsewhere, "zookeeper_tls": without(
        settings.zookeeper_tls, verify_hostname=False)})).close()


def test_plaintext_to_a_tls_port_fails(settings: Settings) -> None:
    cassandra = refusal(settings.model_copy(update={"cassandra_tls": CassandraTlsSettings()}))
    assert isinstance(cassandra, BackendUnavailable), cassandra
    zookeeper = refusal(settings.model_copy(update={"zookeeper_tls": ZooKeeperTlsSettings()}))
    assert isinstance(zookeeper, BackendUnavailable), zookeeper


def test_tls_to_a_plaintext_port_is_refused_clearly(secure_stack: Stack, settings: Settings) -> None:
    # The stack keeps ZooKeeper's plaintext port open for its own checks.
    plain = settings.zookeeper_hosts.replace(secure_stack.zookeeper_tls_hosts or "", secure_stack.zookeeper_hosts)
    error = refusal(settings.model_copy(update={"zookeeper_hosts": plain}))
    assert isinstance(error, TlsRefused) and "does not speak TLS" in str(error), error


def test_a_wrong_password_is_refused(settings: Settings) -> None:
    error = refusal(settings.model_copy(update={"cassandra_password": SecretStr("not-the-password")}))
    assert isinstance(error, AccessDenied) and f"refused user {settings.cassandra_username!r}" in str(error), error
    assert "not-the-password" not in str(error) and "not-the-password" not in repr(error.__cause__)


def test_a_node_that_refused_logins_for_a_while_is_reached_again_once_it_accepts_them(
    secure_stack: Stack, settings: Settings,
) -> None:
    """A node that has just started can refuse logins for a moment, and the driver takes a
    refused login as final: it stops reconnecting to that node. Here a client's node goes
    away (its proxy cut) and comes back refusing the client's password for several
    attempts, then accepts it again: the client is served again without a restart."""
    role, password = f"flaky_{uuid.uuid4().hex[:8]}", "first-password"
    (node,) = secure_stack.cassandra_nodes()
    admin_cluster, admin = cql.connect(settings)
    proxy = Proxy(node.address, secure_stack.ports.native, "cassandra")
    client_settings = settings.model_copy(update={
        "cassandra_contact_points": ["127.0.0.1"], "cassandra_port": proxy.port,
        "cassandra_username": role, "cassandra_password": SecretStr(password),
        "cassandra_tls": settings.cassandra_tls.model_copy(update={"server_hostname": node.address}),
    })
    cluster = None
    try:
        admin.execute(f"CREATE ROLE {role} WITH LOGIN = true AND PASSWORD = %s", (password,))
        cluster, session = wait_for("the client's first connection", lambda: connected(client_settings))
        session.execute("SELECT release_version FROM system.local")
        (host,) = cluster.metadata.all_hosts()

        admin.execute(f"ALTER ROLE {role} WITH PASSWORD = %s", ("another-password",))
        wait_for("a new login with the first password refused", lambda: login_refused(client_settings))
        proxy.cut()
        wait_for("the client's node marked down", lambda: host.is_up is False)
        proxy.heal()
        # While no node is up the control connection has none to try: each connection the
        # proxy accepts now is an attempt of the node's reconnection. The driver makes one,
        # is refused, and stops for good.
        accepted = proxy.accepted
        wait_for("the node tried again after a refused login", lambda: proxy.accepted >= accepted + 2)

        admin.execute(f"ALTER ROLE {role} WITH PASSWORD = %s", (password,))

        def served() -> bool:
            try:
                session.execute("SELECT release_version FROM system.local")
            except Exception:
                return False
            return True
        wait_for("the client served again", served)
        assert host.is_up
    finally:
        if cluster is not None:
            cluster.shutdown()
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin_cluster.shutdown()
        proxy.close()


def test_the_default_superuser_is_disabled_once_the_stack_is_up(settings: Settings) -> None:
    """`casque dev up --auth` (and --secure) leaves only the installation's login, as the
    chart's `casque secure-cassandra` does: cassandra/cassandra logs in no more."""
    default = settings.model_copy(update={"cassandra_username": "cassandra", "cassandra_password": SecretStr("cassandra")})
    error = refusal(default)
    assert isinstance(error, AccessDenied) and "refused user 'cassandra'" in str(error), error


async def test_a_sidecar_with_tls_settings_publishes_and_receives(
    store: Store, settings: Settings, aiohttp_client: Any
) -> None:
    # No Store lent: the sidecar opens its own connections from the settings.
    client: Client = await aiohttp_client(create_app(
        SidecarSettings(queue=QUEUE.name, subscribers=[SUBSCRIBER], drain_seconds=0.5), settings, None))
    deadline = time.monotonic() + 60
    while (await client.get("/readyz")).status != 200:
        assert time.monotonic() < deadline, await (await client.get("/readyz")).text()
        await asyncio.sleep(0.1)
    base = f"/v1/queues/{QUEUE.name}"
    published = await client.post(f"{base}/messages", json={"data": {"amount": 42}})
    assert published.status == 200, await published.text()
    message_id = (await published.json())["messageId"]
    received: list[dict[str, Any]] = []
    while not received:
        assert time.monotonic() < deadline, "the message never arrived"
        answer = await client.post(f"{base}/subscribers/{SUBSCRIBER}/receive", json={"max": 10, "wait": 1})
        assert answer.status == 200, await answer.text()
        received = (await answer.json())["messages"]
    assert [m["messageid"] for m in received] == [message_id]
    assert received[0]["data"] == {"amount": 42}


@pytest.mark.spark
async def test_a_spark_job_reads_over_tls_with_a_password(
    secure_stack: Stack, store: Store, settings: Settings, tmp_path: Path
) -> None:
    publisher = Publisher(store, QUEUE, catalog.read_queue(store, QUEUE))
    for i in range(5):
        await publisher.publish([OutgoingMessage(f"s{i}".encode())])
    await publisher.flush_heads()
    # Its own process: a Python process holds one Spark JVM, and this one needs the TLS options.
    env = {**os.environ, **secure_stack.client_env(), "CASQUE_KEYSPACE": settings.keyspace,
           "CASQUE_ZOOKEEPER_HOSTS": settings.zookeeper_hosts, "CASQUE_CONSISTENCY": "ONE"}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "casque.cli", "spark", "stats", "--queue", QUEUE.name,
                         "--out", str(tmp_path / "stats")],
        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "stats" / "summary.json").read_text())["messages"] == 5


def test_digest_acls_keep_namespaces_apart_over_tls(settings: Settings) -> None:
    installation = Identity("casque", "installation-password-for-tls-tests-0123456789")
    key = "derivation-key-for-tls-tests-0123456789"

    def as_identity(identity: Identity, acl: str | None = None) -> Settings:
        # The installation derives the namespaces' identities; a namespace is given its own.
        derivation_key = SecretStr(key) if acl is None else None
        return settings.model_copy(update={"zookeeper_username": identity.username, "derivation_key": derivation_key,
                                           "zookeeper_password": SecretStr(identity.password), "zookeeper_acl": acl})

    def as_namespace(namespace: str) -> Settings:
        acl = installation_policy(settings.zookeeper_root, [installation], [key]).descendant_acl(namespace)
        return as_identity(namespace_identity(installation.username, key, namespace), format_acl(acl))

    operator = Store.open(as_identity(installation))
    try:
        ensure_installation(operator)
        catalog.apply_queue(operator, QUEUE, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
        own = zk.connect(as_namespace(QUEUE.namespace), namespace=QUEUE.namespace)
        own.stop()
        own.close()
        with pytest.raises(AccessDenied, match="another namespace"):
            zk.connect(as_namespace("team-b"), namespace=QUEUE.namespace)
    finally:
        # Only the installation may delete what it protects (the chroot's own cleanup may not).
        operator.zk.delete(settings.zookeeper_root, recursive=True)
        operator.close()
