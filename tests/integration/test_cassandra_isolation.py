"""A keyspace and a role per namespace (CASQUE_CASSANDRA_ISOLATION=keyspace) on a real
Cassandra with PasswordAuthenticator and CassandraAuthorizer (the `secure_stack` fixture).

The installation (the operator's settings: the superuser) prepares two namespaces as the
operator does; each namespace's sidecar then connects with what the operator and the
webhook hand it (the Secret's role, its keyspace as CASQUE_KEYSPACE) and nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from cassandra import InvalidRequest, Unauthorized
from cassandra.cluster import Session
from cassandra.concurrent import execute_concurrent_with_args
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import SecretStr

from casque.config import Settings
from casque.devstack.kube import KubeCluster
from casque.devstack.stack import Stack
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.errors import AccessDenied, BackendUnavailable
from casque.backends.disk_usage import MEBIBYTE
from casque.operator import namespace_setup, observation, tenancy
from casque.operator.injection import sidecar_keyspace
from casque.operator.resources import GROUP, QUEUES, VERSION
from casque.operator.quotas import MAX_STORED_BYTES
from casque.operator.storage_quota import NamespaceStorage
from casque.schema import (
    ACKS_TABLE,
    CLIENT_IDS_TABLE,
    COUNTERS_TABLE,
    DELAYED_TABLE,
    SCHEMA_CHANGE_TIMEOUT_SECONDS,
    QueueRef,
)
from casque.sidecar.app import create_app
from casque.sidecar.config import SidecarSettings
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import chroot_on, login_for_clean_up
from tests.fixtures.waiting import wait_for
from tests.integration.test_operator import Operator, casque_crds, create, delete, get, queue, wait_ready  # noqa: F401
from tests.integration.test_transport_security import secure_settings

pytestmark = pytest.mark.integration

A, B = "team-a", "team-b"
SUBSCRIBER = "ledger"
SPEC = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
Client = TestClient[web.Request, web.Application]
ZOOKEEPER_LOGIN = ("CASQUE_ZOOKEEPER_SASL", "CASQUE_ZOOKEEPER_USERNAME", "CASQUE_ZOOKEEPER_PASSWORD")


@pytest.fixture
def installation(secure_stack: Stack) -> Iterator[Settings]:
    """The operator's settings, with a keyspace (and so namespace keyspaces) and a ZooKeeper
    chroot of this test's own; both namespaces' keyspaces and roles dropped afterwards."""
    hosts = secure_stack.zookeeper_tls_hosts
    assert hosts is not None
    keyspace = f"i{uuid.uuid4().hex[:12]}"
    with chroot_on(hosts, **secure_stack.zookeeper_client_options()) as chrooted:
        settings = secure_settings(secure_stack, keyspace, chrooted, cassandra_isolation="keyspace",
                                   derivation_key=SecretStr(secrets.token_urlsafe(32)))
        yield settings
        admin = login_for_clean_up(settings)
        try:
            for namespace in (A, B):
                role = tenancy.cassandra_role(settings, namespace)
                assert role is not None
                catalog.drop_namespace_role(admin, role)
                admin.session.execute(f"DROP KEYSPACE IF EXISTS {role.keyspace}", timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
            admin.session.execute(f"DROP KEYSPACE IF EXISTS {keyspace}", timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
        finally:
            admin.close()


@pytest.fixture
def operator(installation: Settings) -> Iterator[Store]:
    """The installation's Store, after the operator's work for a Queue `orders` with a
    Subscriber in each namespace: keyspace, role, tables, znodes."""
    store = namespace_setup.open_store(installation)
    try:
        for namespace in (A, B):
            role = tenancy.cassandra_role(installation, namespace)
            assert role is not None
            namespace_setup.prepare_namespace_cassandra(lambda: store, namespace, role)
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


def wait_until_login_refused(settings: Settings, namespace: str) -> None:
    """Wait for a dropped role's (or an old password's) login to be refused: Cassandra caches
    credentials for a while (credentials_validity)."""
    def refused_now() -> bool:
        try:
            Store.open(settings, namespace=namespace).close()
        except AccessDenied:
            return True
        except BackendUnavailable:
            return False  # refused by a pool but not the control connection: no reason given, try again
        return False

    wait_for(f"{namespace}'s dropped role to be refused", refused_now, timeout=60)


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


async def test_a_namespaces_role_cannot_write_a_value_past_the_bound(operator: Store, installation: Settings) -> None:
    """Cassandra's guardrails bind every role but superusers: a namespace's role, which may write
    its own keyspace's rows directly, tried a 6 MiB value (its queue takes 256 KiB messages).
    Before, it was accepted."""
    sidecar_a = Store.open(sidecar_settings(installation, A), namespace=A)
    table = f"{operator.keyspace_of(A)}.{QueueRef(A, 'orders').messages_table}"
    try:
        with pytest.raises(InvalidRequest, match="column_value_size"):
            sidecar_a.session.execute(
                f"INSERT INTO {table} (shard, bucket, batch_no, seq, message_id, payload) VALUES (0, 0, 999, 1, 'big', %s)",
                (b"x" * (6 * 1024 * 1024),))
    finally:
        sidecar_a.close()
    assert list(operator.session.execute(f"SELECT seq FROM {table} WHERE shard = 0 AND bucket = 0 AND batch_no = 999")) == []


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
        seen = await observation.observe_queue(operator, QueueRef(namespace, "orders"))
        assert observation.queue_drift(SPEC, seen) == [], namespace
        assert seen.stats.published_messages == (4 if namespace == B else 0), namespace
    role = tenancy.cassandra_role(installation, A)
    assert role is not None
    catalog.drop_namespace_role(operator, role)
    # The keyspace stays, with its tables.
    assert operator.session.execute(
        "SELECT keyspace_name FROM system_schema.keyspaces WHERE keyspace_name = %s", (role.keyspace,)).one()
    wait_until_login_refused(sidecar_settings(installation, A), A)


def login_works(settings: Settings, namespace: str) -> bool:
    try:
        Store.open(settings, namespace=namespace).close()
    except (AccessDenied, BackendUnavailable):
        return False
    return True


async def test_a_new_derivation_key_resets_the_namespaces_password_and_the_old_one_is_refused(
    operator: Store, installation: Settings
) -> None:
    """Rotating the derivation key: the operator, restarted with the new key, sets each
    namespace role's new password on its next reconcile and writes the new Secret; from then
    on Cassandra refuses the old password, and the new one works."""
    old = sidecar_settings(installation, A)
    assert login_works(old, A)
    rotated = installation.model_copy(update={"derivation_key": SecretStr(secrets.token_urlsafe(32))})
    new = sidecar_settings(rotated, A)
    assert new.cassandra_username == old.cassandra_username and new.keyspace == old.keyspace
    assert new.cassandra_password != old.cassandra_password
    assert not login_works(new, A)  # the role still has the old key's password

    role = tenancy.cassandra_role(rotated, A)
    assert role is not None
    namespace_setup.prepare_namespace_cassandra(lambda: operator, A, role)  # the reconcile's step

    wait_until_login_refused(old, A)
    wait_for("the new password to be accepted", lambda: login_works(new, A))
    sidecar = Store.open(new, namespace=A)
    try:
        assert await publish(sidecar, QueueRef(A, "orders"), 2)
    finally:
        sidecar.close()
    # B's role is untouched until its own reconcile: rotation is per role, never a shared login.
    assert login_works(sidecar_settings(installation, B), B)


async def test_ids_published_through_the_installations_store_land_in_the_namespaces_keyspace(
    operator: Store,
) -> None:
    """Idempotent publish through the installation's Store (the operator's, or a CLI's)
    records its ids with the queue's namespace, where that namespace's retries look."""
    queue = QueueRef(A, "orders")
    publisher = Publisher(operator, queue, catalog.read_queue(operator, queue))
    (first,) = await publisher.publish([OutgoingMessage(b"pay", client_id="order-1")])
    again = Publisher(operator, queue, catalog.read_queue(operator, queue))
    (second,) = await again.publish([OutgoingMessage(b"pay", client_id="order-1")])
    assert second.duplicate and second.message_id == first.message_id
    found = operator.session.execute(f"SELECT client_id FROM {operator.keyspace_of(A)}.{CLIENT_IDS_TABLE}")
    assert [row.client_id for row in found] == ["order-1"]
    assert not list(operator.session.execute(f"SELECT client_id FROM {operator.keyspace}.{CLIENT_IDS_TABLE}"))


# --- the operator on a real API server ----------------------------------------------------------


@pytest.fixture
def operator_env(secure_stack: Stack, installation: Settings, kube_cluster: KubeCluster) -> dict[str, str]:
    """`casque operator run`'s environment: the installation's settings, as the chart gives them."""
    assert installation.derivation_key is not None
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("CASQUE_")},
        # The installation's ZooKeeper identity is the test's (none): not the stack's SASL login.
        **{k: v for k, v in secure_stack.client_env().items() if k not in ZOOKEEPER_LOGIN},
        "KUBECONFIG": str(kube_cluster.kubeconfig_path),
        "CASQUE_KEYSPACE": installation.keyspace,
        "CASQUE_ZOOKEEPER_HOSTS": installation.zookeeper_hosts,
        "CASQUE_CONSISTENCY": "ONE",
        "CASQUE_CASSANDRA_ISOLATION": "keyspace",
        "CASQUE_DERIVATION_KEY": installation.derivation_key.get_secret_value(),
    }


def annotate(core: client.CoreV1Api, namespace: str, annotations: dict[str, str]) -> None:
    core.patch_namespace(namespace, {"metadata": {"annotations": annotations}})


def publishing(api: client.CustomObjectsApi, namespace: str, queue_name: str) -> str | None:
    """The status of the Queue's Publishing condition (None: not reported yet)."""
    found = get(api, namespace, QUEUES, queue_name) or {}
    for condition in found.get("status", {}).get("conditions", []):
        if condition.get("type") == "Publishing":
            return str(condition.get("status"))
    return None


def publish_refused(store: Store, queue: QueueRef) -> bool:
    try:
        asyncio.run(publish(store, queue, 1))
    except Unauthorized:
        return True
    return False


def secret_data(core: client.CoreV1Api, namespace: str) -> dict[str, str] | None:
    try:
        secret = core.read_namespaced_secret(tenancy.CASSANDRA_SECRET, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return {key: base64.b64decode(value).decode() for key, value in (secret.data or {}).items()}


def test_the_operator_gives_a_namespace_its_role_with_the_first_queue_and_takes_it_with_the_last(
    operator_env: dict[str, str],
    installation: Settings,
    secure_stack: Stack,
    kube_client: client.ApiClient,
    kube_namespace: str,
    casque_crds: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """...and, between the two, holds its publishes back while its keyspace stores more than
    the Namespace's annotation allows, and lets them through once the limit is lifted."""
    api, core, ns = client.CustomObjectsApi(kube_client), client.CoreV1Api(kube_client), kube_namespace
    role = tenancy.cassandra_role(installation, ns)
    assert role is not None
    running = Operator({**operator_env, "CASQUE_OPERATOR_REFRESH_INTERVAL": "1"}, ns, tmp_path / "operator.log")
    try:
        create(api, ns, queue("orders", deletionPolicy="Delete", consistency="ONE"))
        create(api, ns, queue("audit", deletionPolicy="Delete", consistency="ONE"))
        wait_ready(api, ns, QUEUES, "orders")
        wait_ready(api, ns, QUEUES, "audit")
        data = secret_data(core, ns)
        assert data == {"username": role.username, "password": role.password, "keyspace": role.keyspace}
        assert installation.cassandra_password is not None
        assert installation.cassandra_password.get_secret_value() not in str(data)

        # The Secret's role works on the namespace's queue, in the namespace's keyspace.
        own = installation.model_copy(update={
            "keyspace": data["keyspace"], "cassandra_isolation": "none", "cassandra_username": data["username"],
            "cassandra_password": SecretStr(data["password"])})
        sidecar = Store.open(own, namespace=ns)
        try:
            assert asyncio.run(publish(sidecar, QueueRef(ns, "orders"), 2))
            refused(sidecar.session, f"SELECT * FROM {installation.keyspace}.{ACKS_TABLE}")

            # Past its stored-bytes limit (what it flushed is a MiB at least; the limit, a byte).
            secure_stack.cassandra_nodes()[0].nodetool("flush", role.keyspace)
            annotate(core, ns, {MAX_STORED_BYTES: "1"})
            wait_for("orders to say it may not publish", lambda: publishing(api, ns, "orders") == "False")
            assert "StoredBytesQuotaExceeded" in str(get(api, ns, QUEUES, "orders"))
            wait_for("Cassandra to refuse the namespace's publishes",
                     lambda: publish_refused(sidecar, QueueRef(ns, "orders")))
            annotate(core, ns, {MAX_STORED_BYTES: ""})  # lifted
            wait_for("orders to say it may publish", lambda: publishing(api, ns, "orders") == "True")
            wait_for("Cassandra to take the namespace's publishes again",
                     lambda: not publish_refused(sidecar, QueueRef(ns, "orders")))
        finally:
            sidecar.close()

        # One Queue deleted: the other still needs the role. The last one: Secret and role go.
        delete(api, ns, QUEUES, "orders")
        wait_for("orders to be gone", lambda: get(api, ns, QUEUES, "orders") is None)
        assert secret_data(core, ns) == data
        delete(api, ns, QUEUES, "audit")
        wait_for("the namespace's Secret to be deleted with its last Queue", lambda: secret_data(core, ns) is None)

        wait_until_login_refused(own, ns)
    finally:
        for name in ("orders", "audit"):
            delete(api, ns, QUEUES, name)
        try:
            wait_for("the test's Queues to be deleted", lambda: not api.list_namespaced_custom_object(
                GROUP, VERSION, ns, QUEUES)["items"], timeout=120)
        finally:
            running.stop()
            print(f"--- operator log\n{running.log()[-6000:]}")


def test_casque_apply_gives_a_namespace_its_keyspace_and_role_as_the_operator_does(
    installation: Settings, tmp_path: Path
) -> None:
    """`casque apply` on a stack with keyspace isolation (`casque dev up --secure`) makes what
    the operator makes before a namespace's first Queue: its keyspace and its role, so the
    namespace's own login reaches the queue's table."""
    tls = installation.cassandra_tls
    env = {
        "CASQUE_CASSANDRA_CONTACT_POINTS": ",".join(installation.cassandra_contact_points),
        "CASQUE_CASSANDRA_PORT": str(installation.cassandra_port),
        "CASQUE_CASSANDRA_USERNAME": str(installation.cassandra_username),
        "CASQUE_CASSANDRA_PASSWORD": installation.cassandra_password.get_secret_value(),  # type: ignore[union-attr]
        "CASQUE_CASSANDRA_TLS_ENABLED": "true", "CASQUE_CASSANDRA_TLS_CA_FILE": str(tls.ca_file),
        "CASQUE_CASSANDRA_TLS_CERT_FILE": str(tls.cert_file), "CASQUE_CASSANDRA_TLS_KEY_FILE": str(tls.key_file),
        "CASQUE_ZOOKEEPER_HOSTS": installation.zookeeper_hosts,
        "CASQUE_ZOOKEEPER_TLS_ENABLED": "true", "CASQUE_ZOOKEEPER_TLS_CA_FILE": str(tls.ca_file),
        "CASQUE_ZOOKEEPER_TLS_CERT_FILE": str(tls.cert_file), "CASQUE_ZOOKEEPER_TLS_KEY_FILE": str(tls.key_file),
        "CASQUE_KEYSPACE": installation.keyspace, "CASQUE_CONSISTENCY": "ONE",
        "CASQUE_CASSANDRA_ISOLATION": "keyspace",
        "CASQUE_DERIVATION_KEY": installation.derivation_key.get_secret_value(),  # type: ignore[union-attr]
    }
    documents = tmp_path / "queue.yaml"
    documents.write_text(f"apiVersion: casque.io/v1alpha1\nkind: Queue\nmetadata: {{name: invoices, namespace: {A}}}\n"
                         "spec: {shards: 1}\n")
    done = subprocess.run([sys.executable, "-m", "casque.cli", "apply", "-f", str(documents)], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    role = tenancy.cassandra_role(installation, A)
    assert role is not None
    assert f"namespace {A}: keyspace {role.keyspace} and Cassandra role {role.username}" in done.stdout
    namespace = Store.open(sidecar_settings(installation, A), namespace=A)
    try:
        table = QueueRef(A, "invoices").messages_table
        assert list(namespace.session.execute(f"SELECT * FROM {role.keyspace}.{table} LIMIT 1")) == []
    finally:
        namespace.close()


async def publishing_sidecar(aiohttp_client: Any, installation: Settings, namespace: str) -> TestClient:
    """The namespace's sidecar of queue `orders`, ready. It only publishes: one consuming too
    would join the subscriber's group and hold shards that a test's consumer waits for."""
    app: TestClient = await aiohttp_client(create_app(
        SidecarSettings(namespace=namespace, queue="orders", drain_seconds=0.5),
        sidecar_settings(installation, namespace), None))
    deadline = time.monotonic() + 60
    while (await app.get("/readyz")).status != 200:
        assert time.monotonic() < deadline, await (await app.get("/readyz")).text()
        await asyncio.sleep(0.1)
    return app


async def test_a_namespace_over_its_stored_bytes_may_not_publish_and_its_consumers_still_drain(
    operator: Store, installation: Settings, secure_stack: Stack, aiohttp_client: Any
) -> None:
    """A's role wrote past its sidecar: rows of 64 KiB straight into its queue's table with
    `USING TTL 0`, so they never expire. Measured on disk, A is over a quota of 6 MiB and B,
    which stored little, is within it. The operator's verdict narrows A's writes: Cassandra
    refuses A's publishes, through its sidecar (a 403 that says why) and straight into its
    tables, while A's consumer still receives and acks what A holds, and B publishes as
    before. Lifting the limit lets A publish again. Before, nothing measured a namespace's
    bytes, and its role could write its keyspace without bound."""
    role_a, role_b = tenancy.cassandra_role(installation, A), tenancy.cassandra_role(installation, B)
    assert role_a is not None and role_b is not None
    quota = 6 * MEBIBYTE
    mine = QueueRef(A, "orders")
    sidecar_a = Store.open(sidecar_settings(installation, A), namespace=A)
    sidecar_b = Store.open(sidecar_settings(installation, B), namespace=B)
    storage = NamespaceStorage(interval_seconds=0)
    try:
        held = await publish(sidecar_a, mine, 3)
        blob = os.urandom(64 * 1024)
        insert = sidecar_a.session.prepare(
            f"INSERT INTO {sidecar_a.table(mine)} (shard, bucket, batch_no, seq, message_id, payload) "
            "VALUES (0, 0, ?, 0, ?, ?) USING TTL 0")
        for batch in range(160):
            sidecar_a.session.execute(insert, (10_000 + batch, f"forged-{batch}", blob))
        node = secure_stack.cassandra_nodes()[0]
        for keyspace in (role_a.keyspace, role_b.keyspace):
            await asyncio.to_thread(node.nodetool, "flush", keyspace)

        # Cassandra rounds each table up to a whole MiB: B's few small tables count a MiB each.
        over = storage.verdict(operator, role_a, A, limit=quota)
        within = storage.verdict(operator, role_b, B, limit=quota)
        assert over.stored.bytes >= 10 * MEBIBYTE and not over.publishing, over.describe()
        assert within.publishing, within.describe()
        storage.enforce(operator, role_a, A, over)
        storage.enforce(operator, role_b, B, within)

        def publish_refused() -> bool:
            try:
                sidecar_a.session.execute(insert, (20_000, "forged-late", b"x"))
            except Unauthorized:
                return True
            return False

        wait_for("Cassandra to refuse A's writes to its queue", publish_refused, timeout=60)
        app = await publishing_sidecar(aiohttp_client, installation, A)
        answer = await app.post("/v1/queues/orders/messages", json={"data": {"amount": 1}})
        assert answer.status == 403, await answer.text()
        assert "stored-bytes quota" in (await answer.json())["error"]["message"]
        assert await consume(sidecar_a, mine, held) == held  # acks are still written
        assert len(await publish(sidecar_b, QueueRef(B, "orders"), 2)) == 2

        lifted = storage.verdict(operator, role_a, A, limit=None)
        assert lifted.publishing
        storage.enforce(operator, role_a, A, lifted)
        wait_for("Cassandra to take A's writes again", lambda: not publish_refused(), timeout=60)
        assert len(await publish(sidecar_a, mine, 1)) == 1
    finally:
        sidecar_a.close()
        sidecar_b.close()


RATE_LIMIT = 20  # writes per second; an allowance of BURST_SECONDS (60) of it: 1,200 writes


async def test_a_namespace_past_its_write_rate_may_not_publish_until_its_allowance_refills(
    operator: Store, installation: Settings, secure_stack: Stack, aiohttp_client: Any
) -> None:
    """A's role wrote 1,600 rows straight into its queue's table as fast as Cassandra took
    them, past its sidecar, against a limit of 20 writes a second. The writes Cassandra
    coordinated into A's publishing tables spend A's allowance, and the operator's verdict
    narrows A's writes: Cassandra refuses A's direct writes and its sidecar's publishes (a 403
    naming the write-rate quota), while A's consumer still acks and B, under the same limit,
    publishes. Writing nothing, A's allowance refills at its rate, and A publishes again.
    Before, nothing measured a namespace's writes: its role wrote at any rate."""
    role_a, role_b = tenancy.cassandra_role(installation, A), tenancy.cassandra_role(installation, B)
    assert role_a is not None and role_b is not None
    mine = QueueRef(A, "orders")
    sidecar_a = Store.open(sidecar_settings(installation, A), namespace=A)
    sidecar_b = Store.open(sidecar_settings(installation, B), namespace=B)
    storage = NamespaceStorage(interval_seconds=0)
    try:
        held = await publish(sidecar_a, mine, 3)
        for role, namespace in ((role_a, A), (role_b, B)):  # the baselines
            assert storage.verdict(operator, role, namespace, None, RATE_LIMIT).publishing
        insert = sidecar_a.session.prepare(
            f"INSERT INTO {sidecar_a.table(mine)} (shard, bucket, batch_no, seq, message_id, payload) "
            "VALUES (0, 0, ?, 0, ?, ?) USING TTL 600")
        await asyncio.to_thread(execute_concurrent_with_args, sidecar_a.session, insert,
                                [(30_000 + n, f"flood-{n}", b"x") for n in range(1_600)], concurrency=64)

        over = storage.verdict(operator, role_a, A, None, RATE_LIMIT)
        within = storage.verdict(operator, role_b, B, None, RATE_LIMIT)
        assert over.rate is not None and not over.publishing, over.describe()
        assert over.reason == "WriteRateQuotaExceeded" and "over its limit of 20 writes/s" in over.describe()
        assert within.publishing, within.describe()
        storage.enforce(operator, role_a, A, over)
        storage.enforce(operator, role_b, B, within)

        def write_refused() -> bool:
            try:
                sidecar_a.session.execute(insert, (40_000, "flood-late", b"x"))
            except Unauthorized:
                return True
            return False

        wait_for("Cassandra to refuse A's writes to its queue", write_refused, timeout=60)
        app = await publishing_sidecar(aiohttp_client, installation, A)
        answer = await app.post("/v1/queues/orders/messages", json={"data": {"amount": 1}})
        assert answer.status == 403, await answer.text()
        assert "write-rate quota" in (await answer.json())["error"]["message"]
        assert await consume(sidecar_a, mine, held) == held  # acks are not counted, and still written
        assert len(await publish(sidecar_b, QueueRef(B, "orders"), 2)) == 2

        # Refused writes are not coordinated: A's allowance refills at 20 a second.
        def refilled() -> bool:
            verdict = storage.verdict(operator, role_a, A, None, RATE_LIMIT)
            return verdict.publishing and storage.enforce(operator, role_a, A, verdict)
        wait_for("A's allowance refilled", refilled, timeout=120)
        wait_for("Cassandra to take A's writes again", lambda: not write_refused(), timeout=60)
        assert len(await publish(sidecar_a, mine, 1)) == 1
    finally:
        sidecar_a.close()
        sidecar_b.close()
