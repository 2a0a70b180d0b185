"""ZooKeeper digest authentication and per-namespace ACLs, on the real ZooKeeper.

The installation identity (the operator's) reconciles queues of two namespaces; each
namespace's identity, derived from the installation's, reaches its own namespace only: it
cannot read or move another namespace's offsets, create znodes outside its namespace, or
create queues. A sidecar with its namespace's credentials serves it in both delivery modes,
and every znode it creates carries the policy's ACL. With open ACLs (no credentials), the
refusals below are all accepted by the server, so these tests fail without the ACLs.

ZooKeeper enforces digest ACLs out of the box (no server setting is needed), so the tests
use the session's ZooKeeper, under an installation root of their own in the test's chroot.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from cassandra.cluster import Session
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NoNodeError
from kazoo.security import OPEN_ACL_UNSAFE, Permissions
from pydantic import SecretStr

from casque.backends import zk
from casque.backends.zkacl import Identity, format_acl, installation_policy, namespace_identity
from casque.config import Settings
from casque.engine import catalog
from casque.engine.consumer import Consumer
from casque.engine.grants import QueueGrant
from casque.errors import AccessDenied, QuotaExceeded
from casque.schema import QueueRef
from casque.specs import QueueSpec, QueueState, SubscriberSpec
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.sidecars import SidecarProcess
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import wait_for

ROOT = "/secure"
INSTALLATION = Identity("casque", "installation-password-for-tests-only-0123456789")
ROTATED = Identity(INSTALLATION.username, "the-new-installation-password-0123456789")
A = QueueRef("team-a", "orders")
B = QueueRef("team-b", "orders")
REPLICATION = "{'class': 'SimpleStrategy', 'replication_factor': 1}"


def settings(zk_hosts: str, identity: Identity | None, acl: str | None = None) -> Settings:
    if identity is None:
        return Settings(zookeeper_hosts=zk_hosts, zookeeper_root=ROOT)
    return Settings(zookeeper_hosts=zk_hosts, zookeeper_root=ROOT, zookeeper_username=identity.username,
                    zookeeper_password=SecretStr(identity.password), zookeeper_acl=acl)


def namespace_settings(zk_hosts: str, namespace: str, installation: Sequence[Identity] = (INSTALLATION,)) -> Settings:
    """What the operator's Secret gives a namespace's sidecars."""
    acl = format_acl(installation_policy(ROOT, installation).descendant_acl(namespace))
    return settings(zk_hosts, namespace_identity(installation[0], namespace), acl)


def env_of(namespace: str) -> dict[str, str]:
    given = namespace_settings("", namespace)
    assert given.zookeeper_username and given.zookeeper_password and given.zookeeper_acl
    return {"CASQUE_ZOOKEEPER_ROOT": ROOT, "CASQUE_ZOOKEEPER_USERNAME": given.zookeeper_username,
            "CASQUE_ZOOKEEPER_PASSWORD": given.zookeeper_password.get_secret_value(),
            "CASQUE_ZOOKEEPER_ACL": given.zookeeper_acl, "CASQUE_SIDECAR_NAMESPACE": namespace}


@pytest.fixture
def clients(zk_hosts: str) -> Iterator[list[KazooClient]]:
    """Clients the test opens; closed at the end, the installation's root removed by an
    installation client (the chroot's unauthenticated cleanup may not read secured znodes)."""
    opened: list[KazooClient] = []
    yield opened
    # Both installation passwords: the rotation test leaves ACLs naming the new one only.
    admin = KazooClient(hosts=zk_hosts, auth_data=[INSTALLATION.auth, ROTATED.auth])
    admin.start(timeout=15)
    try:
        admin.delete(ROOT, recursive=True)
    except NoNodeError:
        pass
    finally:
        admin.stop()
        admin.close()
    for client in opened:
        client.stop()
        client.close()


@pytest.fixture
def operator_store(cql: Session, keyspace: str, zk_hosts: str, clients: list[KazooClient]) -> Store:
    """The installation identity's Store, as the operator opens it, with both namespaces' queues."""
    client = zk.connect(settings(zk_hosts, INSTALLATION))
    clients.append(client)
    store = Store(cql, client, keyspace, ROOT, REPLICATION)
    for ref in (A, B):
        catalog.apply_queue(store, ref, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
        catalog.apply_subscriber(store, ref, "billing", SubscriberSpec(queue=ref.name, start_position="earliest"))
    return store


def connect_as(zk_hosts: str, namespace: str, clients: list[KazooClient], serving: str | None = None) -> KazooClient:
    client = zk.connect(namespace_settings(zk_hosts, namespace), namespace=serving or namespace)
    clients.append(client)
    return client


def test_a_namespace_identity_reaches_its_own_namespace_only(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    own = operator_store.paths(A).subscriber("billing")
    other = operator_store.paths(B).subscriber("billing")
    a = connect_as(zk_hosts, A.namespace, clients)

    # Its own subscriber: read, move the offset, register a member, as a sidecar does.
    a.get(own.base)
    a.set(own.offset(0), b"5")
    a.create(own.member("m1"), b"{}", ephemeral=True)

    # The other namespace's: no read, no offset move, no create.
    for refused in (
        lambda: a.get(other.base),
        lambda: a.get(other.offset(0)),
        lambda: a.set(other.offset(0), b"999"),
        lambda: a.get_children(f"{ROOT}/queues/{B.namespace}"),
        lambda: a.create(other.member("intruder"), b"", ephemeral=True),
        lambda: a.delete(other.offset(0)),
    ):
        with pytest.raises(NoAuthError):
            refused()
    # Nothing outside its namespace, and no queue of its own making (that is the operator's).
    for path in (f"{ROOT}/queues/team-c", f"{ROOT}/elsewhere", f"{ROOT}/queues/{A.namespace}/rogue"):
        with pytest.raises(NoAuthError):
            a.create(path, b"")
    # No ADMIN anywhere: it cannot open its own znodes to others, or lock the operator out.
    with pytest.raises(NoAuthError):
        a.set_acls(own.offset(0), OPEN_ACL_UNSAFE)

    # B's offset is untouched, and the operator still reads and writes both namespaces.
    assert operator_store.zk.get(other.offset(0))[0] == b"1"
    assert operator_store.zk.get(own.offset(0))[0] == b"5"
    assert catalog.list_subscribers(operator_store, B) == ["billing"]
    catalog.apply_queue(operator_store, B, QueueSpec(shards=3, retention_seconds=3600, consistency="ONE"))
    assert operator_store.zk.get(other.offset(2))[0] == b"1"  # added by the operator under B's ACLs
    assert catalog.delete_subscriber(operator_store, A, "billing").changed  # members of A's sidecars included


async def test_a_namespace_that_rewrites_its_queue_spec_is_fenced_until_the_operator_restores_it(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    """A namespace's identity may write its own spec znode (its sidecars write below it), so
    it can rewrite its queue to 256 shards and 10 priority levels; the quota holds anyway:
    the engine acts on no spec beyond the queue's grant, which the namespace cannot write,
    and the operator's next apply restores the spec (no InvalidChange for "removing" shards)."""
    approved = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    tenant = connect_as(zk_hosts, A.namespace, clients)
    tenant_store = Store(operator_store.session, tenant, operator_store.keyspace, ROOT, REPLICATION)
    assert catalog.read_queue(tenant_store, A).spec.shards == 2
    paths = operator_store.paths(A)

    state = QueueState.model_validate_json(tenant.get(paths.base)[0])
    grown = state.model_copy(update={"spec": state.spec.model_copy(update={"shards": 256, "priorities": 10})})
    tenant.set(paths.base, grown.model_dump_json().encode())  # the attack: allowed by the ACLs
    tenant.create(paths.head(9255), b"0", makepath=True)
    # The grant is outside the namespace's subtree: it reads it, never writes or replaces it.
    assert QueueGrant.model_validate_json(tenant.get(paths.grant)[0]).shards == 2
    forged = QueueGrant(shards=256, priorities=10, retention_seconds=3600).model_dump_json().encode()
    for refused in (lambda: tenant.set(paths.grant, forged), lambda: tenant.delete(paths.grant),
                    lambda: tenant.create(f"{ROOT}/grants/{A.namespace}/other", forged)):
        with pytest.raises(NoAuthError):
            refused()

    # The engine refuses the spec, whoever reads it: the namespace's sidecar, or the operator.
    for reader in (tenant_store, operator_store):
        with pytest.raises(QuotaExceeded, match=r"256 shards \(granted 2\).*10 priority levels \(granted 1\)"):
            catalog.read_queue(reader, A)
    with pytest.raises(QuotaExceeded):
        await Consumer(tenant_store, A, "billing").start()

    # The operator's next apply puts the approved spec back, and the queue serves again.
    changes = catalog.apply_queue(operator_store, A, approved)
    assert "queue spec restored (it was changed outside the operator)" in changes.actions
    assert catalog.read_queue(tenant_store, A).spec == approved
    # Growth the installation applies is granted with it.
    catalog.apply_queue(operator_store, A, approved.model_copy(update={"shards": 3}))
    assert catalog.read_queue(tenant_store, A).spec.shards == 3
    assert QueueGrant.model_validate_json(tenant.get(paths.grant)[0]).shards == 3


def test_a_sidecar_given_another_namespaces_credentials_is_refused_clearly(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    with pytest.raises(AccessDenied, match="team-b.*another namespace"):
        connect_as(zk_hosts, A.namespace, clients, serving=B.namespace)
    # A wrong password is no better: ZooKeeper takes any digest, and the ACLs refuse it.
    wrong = namespace_settings(zk_hosts, A.namespace).model_copy(update={"zookeeper_password": SecretStr("g" * 32)})
    with pytest.raises(AccessDenied):
        zk.connect(wrong, namespace=A.namespace)
    # Its credentials without the ACL it must create with: refused before it creates anything.
    bare = namespace_settings(zk_hosts, A.namespace).model_copy(update={"zookeeper_acl": None})
    with pytest.raises(AccessDenied, match="CASQUE_ZOOKEEPER_ACL"):
        zk.connect(bare, namespace=A.namespace)


def test_every_znode_the_operator_creates_carries_the_policys_acl(operator_store: Store) -> None:
    policy = installation_policy(ROOT, [INSTALLATION])
    reader = namespace_identity(INSTALLATION, A.namespace).acl_id
    assert_acls_follow(operator_store.zk, policy)
    namespace_acl, _ = operator_store.zk.get_acls(f"{ROOT}/queues/{A.namespace}")
    assert {(e.perms, e.id) for e in namespace_acl} == {(Permissions.ALL, INSTALLATION.acl_id),
                                                        (Permissions.READ, reader)}


def assert_acls_follow(client: KazooClient, policy: Any) -> int:
    """Walk the installation and check every znode's ACL against the policy; the count walked."""
    walked = 0
    pending = [ROOT]
    while pending:
        path = pending.pop()
        try:
            acl, _ = client.get_acls(path)
            children = client.get_children(path)
        except NoNodeError:
            continue  # an ephemeral znode gone meanwhile
        assert set(acl) == set(policy.acl_for(path)), path
        walked += 1
        pending.extend(f"{path}/{child}" for child in children)
    return walked


async def test_a_sidecar_with_its_namespaces_credentials_serves_it_and_creates_only_policy_acls(
    operator_store: Store, start_sidecar: Callable[..., SidecarProcess]
) -> None:
    catalog.apply_subscriber(operator_store, A, "pool", SubscriberSpec(
        queue=A.name, start_position="earliest", delivery="shared"))
    sidecar = start_sidecar("--queue", A.name, "--subscriber", "billing", "--subscriber", "pool", env=env_of(A.namespace))
    async with AsyncClient(sidecar.url, queue=A.name) as client:
        published = {r.message_id for r in await client.publish_batch([{"data": i} for i in range(20)])}
        await client.publish({"later": True}, delay=1)  # goes through the delayed-message mover
        for subscriber in ("billing", "pool"):
            got: set[str] = set()
            deadline = time.monotonic() + 60
            while not published <= got:
                assert time.monotonic() < deadline, f"{subscriber} received {len(got)} of {len(published)}"
                messages = await client.receive(max=50, wait=2, subscriber=subscriber)
                await client.ack_batch([m.receipt for m in messages], subscriber=subscriber)
                got |= {m.message_id for m in messages}
        await client.seek("earliest", subscriber="billing")
        await client.seek("earliest", subscriber="pool")
        assert await client.receive(max=5, wait=10, subscriber="pool")

    # Members, leases, fences, cursors, claims, seek records, the mover's election: all
    # made by the sidecar, walked while it still runs (its ephemeral znodes exist).
    members = operator_store.paths(A).subscriber("pool").members
    wait_for("the sidecar's member znodes", lambda: operator_store.zk.get_children(members))
    # The pool's open range (five messages received, not acked) is on either shard.
    pool = operator_store.paths(A).subscriber("pool")
    assert any(operator_store.zk.exists(pool.claims(s)) and operator_store.zk.get_children(pool.claims(s))
               for s in (0, 1)), "no claim of the pool to check"
    assert assert_acls_follow(operator_store.zk, installation_policy(ROOT, [INSTALLATION])) > 30


def test_a_sidecar_serving_another_namespace_says_why_it_is_not_ready(
    operator_store: Store, start_sidecar: Callable[..., SidecarProcess]
) -> None:
    sidecar = start_sidecar("--queue", B.name, wait=False,
                            env={**env_of(A.namespace), "CASQUE_SIDECAR_NAMESPACE": B.namespace})

    def refused() -> str | None:
        status, body = sidecar.readiness()
        text = str(body)
        return text if status == 503 and "ZooKeeper refused" in text else None

    assert "another namespace" in wait_for("readyz to name the refusal", refused)
    assert sidecar.alive  # no crash loop: it keeps answering /healthz and /readyz
    assert INSTALLATION.password not in sidecar.tail(20000)
    assert namespace_identity(INSTALLATION, A.namespace).password not in sidecar.tail(20000)


def test_an_open_installation_is_secured_in_place(
    cql: Session, keyspace: str, zk_hosts: str, clients: list[KazooClient], backends: Backends
) -> None:
    """Turning authentication on for an installation that ran without it: its open znodes
    get the policy's ACLs, after which namespaces are apart."""
    open_client = zk.connect(settings(zk_hosts, None))
    clients.append(open_client)
    legacy = Store(cql, open_client, keyspace, ROOT, REPLICATION)
    for ref in (A, B):
        catalog.apply_queue(legacy, ref, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
        catalog.apply_subscriber(legacy, ref, "billing", SubscriberSpec(queue=ref.name))
    a = connect_as(zk_hosts, A.namespace, clients)
    a.set(legacy.paths(B).subscriber("billing").offset(0), b"1")  # open: anyone may

    admin = zk.connect(settings(zk_hosts, INSTALLATION))
    clients.append(admin)
    secured = Store(cql, admin, keyspace, ROOT, REPLICATION)
    assert catalog.secure_znodes(secured) > 10
    # The administrators' command, run again: nothing left to change.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CASQUE_")},
           "CASQUE_CASSANDRA_CONTACT_POINTS": ",".join(backends.contact_points),
           "CASQUE_CASSANDRA_PORT": str(backends.cql_port), "CASQUE_KEYSPACE": keyspace,
           "CASQUE_ZOOKEEPER_HOSTS": zk_hosts, "CASQUE_ZOOKEEPER_ROOT": ROOT,
           "CASQUE_ZOOKEEPER_USERNAME": INSTALLATION.username, "CASQUE_ZOOKEEPER_PASSWORD": INSTALLATION.password}
    again = subprocess.run([sys.executable, "-m", "casque.cli", "secure-znodes"], env=env, capture_output=True,
                           text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "0 znodes of the installation given their ACL"
    assert_acls_follow(admin, installation_policy(ROOT, [INSTALLATION]))
    with pytest.raises(NoAuthError):
        a.set(legacy.paths(B).subscriber("billing").offset(0), b"1")
    with pytest.raises(NoAuthError):
        open_client.get(legacy.paths(A).base)  # no identity at all: nothing


def test_rotating_the_installation_password_keeps_old_and_new_sidecars_working(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    new = ROTATED
    rotating = Settings(zookeeper_hosts=zk_hosts, zookeeper_root=ROOT, zookeeper_username=new.username,
                        zookeeper_password=SecretStr(new.password),
                        zookeeper_previous_password=SecretStr(INSTALLATION.password))
    during = zk.connect(rotating)
    clients.append(during)
    store = Store(operator_store.session, during, operator_store.keyspace, ROOT, REPLICATION)
    assert catalog.secure_znodes(store) > 10
    offset = store.paths(A).subscriber("billing").offset(0)
    old_sidecar = connect_as(zk_hosts, A.namespace, clients)
    new_sidecar = zk.connect(namespace_settings(zk_hosts, A.namespace, (new, INSTALLATION)), namespace=A.namespace)
    clients.append(new_sidecar)
    old_sidecar.set(offset, b"2")
    new_sidecar.set(offset, b"3")

    after = zk.connect(settings(zk_hosts, new))  # the previous password dropped
    clients.append(after)
    assert catalog.secure_znodes(Store(operator_store.session, after, operator_store.keyspace, ROOT, REPLICATION)) > 10
    new_sidecar.set(offset, b"4")
    with pytest.raises(NoAuthError):
        old_sidecar.set(offset, b"5")
