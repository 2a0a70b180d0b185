"""A keyspace and a role per namespace (CASQUE_CASSANDRA_ISOLATION=keyspace) on a real
Cassandra with PasswordAuthenticator and CassandraAuthorizer (the `secure_stack` fixture).

The installation (the operator's settings: the superuser) prepares two namespaces as the
operator does; each namespace's sidecar then connects with what the operator and the
webhook hand it (the Secret's role, its keyspace as CASQUE_KEYSPACE) and nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from cassandra import Unauthorized
from cassandra.cluster import Session
from pydantic import SecretStr

from casque.config import Settings
from casque.devstack.stack import Stack
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import AccessDenied
from casque.operator import reconcile, tenancy
from casque.operator.injection import sidecar_keyspace
from casque.schema import ACKS_TABLE, CLIENT_IDS_TABLE, COUNTERS_TABLE, DELAYED_TABLE, QueueRef
from casque.sidecar.app import create_app
from casque.sidecar.config import SidecarSettings
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import chroot_on
from tests.fixtures.waiting import wait_for
from tests.integration.test_transport_security import secure_settings

pytestmark = pytest.mark.integration

A, B = "team-a", "team-b"
SUBSCRIBER = "ledger"
SPEC = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
Client = TestClient[web.Request, web.Application]


@pytest.fixture
def installation(secure_stack: Stack) -> Iterator[Settings]:
    """The operator's settings, with a keyspace (and so namespace keyspaces) and a ZooKeeper
    chroot of this test's own; both namespaces' keyspaces and roles dropped afterwards."""
    hosts = secure_stack.zookeeper_tls_hosts
    assert hosts is not None
    keyspace = f"i{uuid.uuid4().hex[:12]}"
    with chroot_on(hosts, **secure_stack.zookeeper().client_options()) as chrooted:
        settings = secure_settings(secure_stack, keyspace, chrooted, cassandra_isolation="keyspace")
        yield settings
        admin = Store.open(settings)
        try:
            for namespace in (A, B):
                role = tenancy.cassandra_role(settings, namespace)
                assert role is not None
                catalog.drop_namespace_role(admin, role)
                admin.session.execute(f"DROP KEYSPACE IF EXISTS {role.keyspace}")
            admin.session.execute(f"DROP KEYSPACE IF EXISTS {keyspace}")
        finally:
            admin.close()


@pytest.fixture
def operator(installation: Settings) -> Iterator[Store]:
    """The installation's Store, after the operator's work for a Queue `orders` with a
    Subscriber in each namespace: keyspace, role, tables, znodes."""
    store = reconcile.open_store(installation)
    try:
        for namespace in (A, B):
            role = tenancy.cassandra_role(installation, namespace)
            assert role is not None
            reconcile.prepare_namespace_cassandra(lambda: store, namespace, role)
            queue = QueueRef(namespace, "orders")
            catalog.apply_queue(store, queue, SPEC)
            catalog.apply_subscriber(store, queue, SUBSCRIBER, SubscriberSpec(queue="orders", start_position="earliest"))
        yield store
    finally:
        store.close()


def sidecar_settings(installation: Settings, namespace: str) -> Settings:
    """What the webhook and the namespace's Secret give its sidecar: the namespace's keyspace
    and role, and no isolation setting (it knows one keyspace)."""
    secret = tenancy.cassandra_secret(installation, namespace)
    assert secret is not None
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    return installation.model_copy(update={
        "keyspace": sidecar_keyspace(installation, namespace), "cassandra_isolation": "none",
        "cassandra_username": data["username"], "cassandra_password": SecretStr(data["password"])})


def refused(session: Session, statement: str) -> str:
    with pytest.raises(Unauthorized) as error:
        session.execute(statement)
    return str(error.value)


async def publish(store: Store, queue: QueueRef, count: int) -> set[str]:
    publisher = Publisher(store, queue, catalog.read_queue(store, queue))
    results = await asyncio.gather(*(publisher.publish([OutgoingMessage(f"{queue.namespace}-{i}".encode())])
                                     for i in range(count)))
    await publisher.flush_heads()
    return {result[0].message_id for result in results}


async def consume(store: Store, queue: QueueRef, expected: set[str]) -> set[str]:
    consumer = Consumer(store, queue, SUBSCRIBER)
    await consumer.start()
    got: set[str] = set()
    try:
        deadline = time.monotonic() + 60
        while got != expected and time.monotonic() < deadline:
            batch = await consumer.receive(max_messages=50, wait=1.0)
            await asyncio.gather(*(consumer.ack(d.receipt) for d in batch))
            got |= {d.message.message_id for d in batch}
    finally:
        await consumer.stop()
    return got


async def test_a_namespaces_role_reaches_its_own_keyspace_only(operator: Store, installation: Settings) -> None:
    a_keyspace, b_keyspace = operator.keyspace_of(A), operator.keyspace_of(B)
    assert a_keyspace != b_keyspace != installation.keyspace
    # Each namespace's queue table and shared tables live in its own keyspace.
    assert operator.table(QueueRef(B, "orders")).startswith(f"{b_keyspace}.")
    sidecar_b = Store.open(sidecar_settings(installation, B), namespace=B)
    try:
        b_rows = await publish(sidecar_b, QueueRef(B, "orders"), 3)
    finally:
        sidecar_b.close()

    sidecar_a = Store.open(sidecar_settings(installation, A), namespace=A)
    try:
        # A's sidecar does everything on A's queue: publish, consume, ack (counters and acks).
        mine = QueueRef(A, "orders")
        published = await publish(sidecar_a, mine, 5)
        assert await consume(sidecar_a, mine, published) == published

        # ...and nothing on B's: not its messages, nor its shared tables, nor the installation's.
        session = sidecar_a.session
        b_table = QueueRef(B, "orders").messages_table
        assert b_keyspace in refused(session, f"SELECT * FROM {b_keyspace}.{b_table}")
        refused(session, f"INSERT INTO {b_keyspace}.{b_table} (shard, bucket, batch_no, seq, message_id) "
                         "VALUES (0, 0, 99, 0, 'forged')")
        for table in (ACKS_TABLE, DELAYED_TABLE, COUNTERS_TABLE, CLIENT_IDS_TABLE):
            refused(session, f"SELECT * FROM {b_keyspace}.{table}")
            refused(session, f"SELECT * FROM {installation.keyspace}.{table}")
        refused(session, f"UPDATE {b_keyspace}.{COUNTERS_TABLE} SET value = value + 1 "
                         "WHERE queue = 'team-b/orders' AND name = 'forged'")
        # Within its own keyspace it reads and writes rows, but changes neither schema nor grants.
        refused(session, f"DROP TABLE {a_keyspace}.{mine.messages_table}")
        refused(session, f"CREATE TABLE {a_keyspace}.extra (k int PRIMARY KEY)")
        refused(session, f'GRANT SELECT ON KEYSPACE {b_keyspace} TO "{a_keyspace}"')
    finally:
        sidecar_a.close()
    # B's rows are untouched, as the installation sees them.
    rows = operator.session.execute(f"SELECT message_id FROM {operator.table(QueueRef(B, 'orders'))}")
    assert {row.message_id for row in rows} - {None} == b_rows


async def test_a_namespaces_sidecar_serves_its_queue_with_what_the_webhook_gives_it(
    operator: Store, installation: Settings, aiohttp_client: Any
) -> None:
    client: Client = await aiohttp_client(create_app(
        SidecarSettings(namespace=A, queue="orders", subscribers=[SUBSCRIBER], drain_seconds=0.5),
        sidecar_settings(installation, A), None))
    deadline = time.monotonic() + 60
    while (await client.get("/readyz")).status != 200:
        assert time.monotonic() < deadline, await (await client.get("/readyz")).text()
        await asyncio.sleep(0.1)
    published = await client.post("/v1/queues/orders/messages", json={"data": {"amount": 7}})
    assert published.status == 200, await published.text()
    received: list[dict[str, Any]] = []
    while not received:
        assert time.monotonic() < deadline, "the message never arrived"
        answer = await client.post(f"/v1/queues/orders/subscribers/{SUBSCRIBER}/receive", json={"max": 10, "wait": 1})
        assert answer.status == 200, await answer.text()
        received = (await answer.json())["messages"]
    assert [m["data"] for m in received] == [{"amount": 7}]
    # The message is in A's keyspace, not the installation's.
    assert operator.session.execute(f"SELECT count(*) FROM {operator.table(QueueRef(A, 'orders'))}").one()[0] > 0


async def test_the_installation_still_sees_every_namespace_and_a_dropped_role_cannot_log_in(
    operator: Store, installation: Settings
) -> None:
    # The operator's reads go to each namespace's keyspace (its status refresh, figures included).
    sidecar_b = Store.open(sidecar_settings(installation, B), namespace=B)
    try:
        await publish(sidecar_b, QueueRef(B, "orders"), 4)
    finally:
        sidecar_b.close()
    for namespace in (A, B):
        seen = await reconcile.observe_queue(operator, QueueRef(namespace, "orders"))
        assert reconcile.queue_drift(SPEC, seen) == [], namespace
        assert seen.stats.published_messages == (4 if namespace == B else 0), namespace
    role = tenancy.cassandra_role(installation, A)
    assert role is not None
    catalog.drop_namespace_role(operator, role)
    # The keyspace stays, with its tables.
    assert operator.session.execute(
        "SELECT keyspace_name FROM system_schema.keyspaces WHERE keyspace_name = %s", (role.keyspace,)).one()
    # Cassandra caches credentials for a while (credentials_validity): wait for the refusal.
    def refused_now() -> bool:
        try:
            Store.open(sidecar_settings(installation, A), namespace=A).close()
        except AccessDenied:
            return True
        return False

    wait_for("the dropped role to be refused", refused_now, timeout=60)
