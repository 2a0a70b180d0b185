"""ZooKeeper digest authentication and per-namespace ACLs, on the real ZooKeeper.

The installation identity (the operator's) reconciles queues of two namespaces; each
namespace's identity, derived from the installation's derivation key, reaches its own
namespace only: it
cannot read or move another namespace's offsets, create znodes outside its namespace, or
create queues. A sidecar with its namespace's credentials serves it in both delivery modes,
and every znode it creates carries the policy's ACL. With open ACLs (no credentials), the
refusals below are all accepted by the server, so these tests fail without the ACLs.

ZooKeeper enforces digest ACLs out of the box (no server setting is needed), so the tests
use the session's ZooKeeper, under an installation root of their own in the test's chroot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from cassandra.cluster import Session
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NoNodeError, QuotaExceededError
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Permissions
from pydantic import SecretStr

from casque.backends import zk
from casque.backends.zkacl import Identity, format_acl, installation_policy, namespace_identity, widen
from casque.config import Settings
from casque.engine import catalog, protocol, protocol_change, znode_quotas
from casque.engine.consumer import Consumer
from casque.engine.grants import QueueGrant
from casque.errors import AccessDenied, InvalidSpec, QuotaExceeded
from casque.operator import namespace_setup, tenancy
from casque.schema import QueueRef
from casque.specs import QueueSpec, QueueState, SubscriberSpec, SubscriberState
from casque.store import Store
from casque_client import AsyncClient
from tests.fixtures.sidecars import SidecarProcess
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import wait_for

ROOT = "/secure"
INSTALLATION = Identity("casque", "installation-password-for-tests-only-0123456789")
ROTATED = Identity(INSTALLATION.username, "the-new-installation-password-0123456789")
KEY = "derivation-key-for-tests-only-0123456789"
NEW_KEY = "the-new-derivation-key-for-tests-0123456789"
A = QueueRef("team-a", "orders")
B = QueueRef("team-b", "orders")
REPLICATION = "{'class': 'SimpleStrategy', 'replication_factor': 1}"


def settings(zk_hosts: str, identity: Identity | None, acl: str | None = None, key: str = KEY,
             previous_key: str | None = None) -> Settings:
    """An installation's settings (with its derivation keys), or with `acl` a namespace's."""
    if identity is None:
        return Settings(zookeeper_hosts=zk_hosts, zookeeper_root=ROOT)
    keys = {} if acl is not None else {
        "derivation_key": SecretStr(key), "previous_derivation_key": SecretStr(previous_key) if previous_key else None}
    return Settings(zookeeper_hosts=zk_hosts, zookeeper_root=ROOT, zookeeper_username=identity.username,
                    zookeeper_password=SecretStr(identity.password), zookeeper_acl=acl, **keys)


def namespace_settings(zk_hosts: str, namespace: str, installation: Sequence[Identity] = (INSTALLATION,),
                       keys: Sequence[str] = (KEY,)) -> Settings:
    """What the operator's Secret gives a namespace's sidecars."""
    acl = format_acl(installation_policy(ROOT, installation, keys).descendant_acl(namespace))
    return settings(zk_hosts, namespace_identity(installation[0].username, keys[0], namespace), acl)


def secret_settings(zk_hosts: str, installation: Settings, namespace: str) -> Settings:
    """A sidecar's settings from the Secret the operator writes with `installation`'s settings."""
    secret = tenancy.zookeeper_secret(installation, namespace)
    assert secret is not None
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    return Settings(zookeeper_hosts=zk_hosts, zookeeper_root=ROOT, zookeeper_username=data["username"],
                    zookeeper_password=SecretStr(data["password"]), zookeeper_acl=data["acl"])


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


def test_every_namespace_reads_the_installations_protocol_and_none_may_change_it(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    """Its sidecars follow the protocol version (casque.engine.protocol); a namespace that could
    write it could make every other namespace's sidecars stop publishing, or write records
    their peers misread."""
    change = protocol_change.set_version(operator_store, 2)
    assert (change.before, change.after) == (1, 2)
    path = protocol.protocol_path(ROOT)
    a = connect_as(zk_hosts, A.namespace, clients)
    assert protocol.parse(a.get(path)[0]).version == 2
    for refused in (lambda: a.set(path, b'{"version": 1}'), lambda: a.delete(path),
                    lambda: a.set_acls(path, OPEN_ACL_UNSAFE)):
        with pytest.raises(NoAuthError):
            refused()
    assert protocol.read(operator_store).version == 2


def test_a_namespace_writes_only_what_its_sidecars_write(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    """Issue 31's attacks with a namespace's own credentials: it rewrites its Subscriber's
    spec (pushUrl, maxDeliveries) and its Queue's (256 shards, 10 priority levels), creates
    a head for a log its queue does not have, a subscriber and an offset of its own making,
    and deletes what the installation made. ZooKeeper refuses each; what its sidecars write
    (heads, offsets, seeks, members, leases, fences, cursors, claims, the mover) it still
    writes. Every refusal below was accepted while a namespace could write every znode of
    its queues."""
    tenant = connect_as(zk_hosts, A.namespace, clients)
    paths = operator_store.paths(A)
    own = paths.subscriber("billing")
    queue_before, _ = tenant.get(paths.base)
    subscriber_before, _ = tenant.get(own.base)
    state = SubscriberState.model_validate_json(subscriber_before)
    hijacked = state.model_copy(update={"spec": state.spec.model_copy(update={
        "push_url": "http://attacker.example/steal", "max_deliveries": 1000})})
    queue = QueueState.model_validate_json(queue_before)
    grown = queue.model_copy(update={"spec": queue.spec.model_copy(update={"shards": 256, "priorities": 10})})

    for attack in (
        lambda: tenant.set(own.base, hijacked.model_dump_json(exclude_none=True).encode()),
        lambda: tenant.set(paths.base, grown.model_dump_json().encode()),
        lambda: tenant.create(paths.head(9255), b"0", makepath=True),
        lambda: tenant.create(f"{paths.shards}/1/head-of-nothing", b"0"),
        lambda: tenant.delete(paths.head(1)),
        lambda: tenant.create(paths.subscriber("rogue").base, b"{}"),
        lambda: tenant.delete(own.base, recursive=True),
        lambda: tenant.create(own.offset(7), b"1"),
        lambda: tenant.delete(own.offset(0)),
        lambda: tenant.delete(own.seek),
        lambda: tenant.create(f"{own.base}/rogue", b""),
        lambda: tenant.create(f"{paths.base}/rogue", b""),
    ):
        with pytest.raises(NoAuthError):
            attack()
    assert operator_store.zk.get(paths.base)[0] == queue_before
    assert operator_store.zk.get(own.base)[0] == subscriber_before
    assert sorted(operator_store.zk.get_children(paths.shards)) == ["0", "1"]
    assert catalog.list_subscribers(operator_store, A) == ["billing"]

    # What its sidecars do, by hand: advance a head and its totals, commit and seek an
    # offset, register a member, take a lease and its fence, claim a range, move the mover,
    # contend for its election, mark a redrive, be present among the queue's publishers.
    tenant.set(paths.head(0), b"0")
    tenant.set(paths.totals(0), b"0 0 0")
    tenant.set(own.offset(0), b"1")
    tenant.set(own.seek, b"{}")
    tenant.set(paths.redrive, b"{}")
    tenant.create(own.member("m1"), b"{}", ephemeral=True)
    tenant.create(own.fence(0), b"")
    tenant.create(own.lease(0), b"m1", ephemeral=True)
    tenant.create(own.cursor(0), b"1")
    tenant.create(f"{own.claims(0)}/0-1", b"{}", makepath=True)
    tenant.delete(f"{own.claims(0)}/0-1")
    tenant.set(paths.mover, tenant.get(paths.mover)[0])
    tenant.create(f"{paths.mover}/election/contender-", b"", ephemeral=True, sequence=True, makepath=True)
    tenant.create(paths.publisher("pod-1a2b3c"), b"{}", ephemeral=True)
    tenant.delete(own.lease(0))


async def test_a_queue_from_before_the_policy_is_fenced_until_the_operator_restores_and_restricts_it(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    """Znodes made by a casque whose namespaces could write every znode of their queues keep
    that ACL until the installation re-applies them. Meanwhile the quota still holds: the
    engine acts on no spec beyond the queue's grant, which the namespace cannot write. The
    operator's next apply restores the spec (no InvalidChange for "removing" shards), makes
    the containers the namespace used to create itself, and gives the queue's znodes their
    ACL: from then on the namespace cannot write its spec."""
    approved = QueueSpec(shards=2, retention_seconds=3600, consistency="ONE")
    paths = operator_store.paths(A)
    own = paths.subscriber("billing")
    # As an older casque left them: no redrive, seek, cursors or claims znodes (its sidecars
    # made those), and every znode below the namespace writable by it.
    for made_by_sidecars in (paths.redrive, own.seek, own.cursors, own.claims_root):
        operator_store.zk.delete(made_by_sidecars)
    old_acl = widen(installation_policy(ROOT, [INSTALLATION], [KEY]).namespace_acl(A.namespace))
    for path in walk(operator_store.zk, paths.base):
        operator_store.zk.set_acls(path, old_acl)

    tenant = connect_as(zk_hosts, A.namespace, clients)
    tenant_store = Store(operator_store.session, tenant, operator_store.keyspace, ROOT, REPLICATION)
    assert catalog.read_queue(tenant_store, A).spec.shards == 2
    state = QueueState.model_validate_json(tenant.get(paths.base)[0])
    grown = state.model_copy(update={"spec": state.spec.model_copy(update={"shards": 256, "priorities": 10})})
    tenant.set(paths.base, grown.model_dump_json().encode())  # the old ACL allows it
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

    # The operator's next apply puts the approved spec back and restricts the ACLs, and
    # the queue serves again.
    changes = catalog.apply_queue(operator_store, A, approved)
    assert "queue spec restored (it was changed outside the operator)" in changes.actions
    assert any(action.endswith("znodes given their ACL") for action in changes.actions), changes.actions
    assert catalog.read_queue(tenant_store, A).spec == approved
    assert not catalog.apply_subscriber(operator_store, A, "billing", SubscriberSpec(
        queue=A.name, start_position="earliest")).changed  # its apply finds nothing left to do
    assert_acls_follow(operator_store.zk, installation_policy(ROOT, [INSTALLATION], [KEY]), under=[paths.base])
    with pytest.raises(NoAuthError):
        tenant.set(paths.base, grown.model_dump_json().encode())
    tenant.set(own.seek, b"{}")  # made by the apply, for its sidecars to write
    # Growth the installation applies is granted with it.
    catalog.apply_queue(operator_store, A, approved.model_copy(update={"shards": 3}))
    assert catalog.read_queue(tenant_store, A).spec.shards == 3
    assert QueueGrant.model_validate_json(tenant.get(paths.grant)[0]).shards == 3


def walk(client: KazooClient, top: str) -> list[str]:
    """`top` and every znode below it."""
    found, pending = [], [top]
    while pending:
        path = pending.pop()
        found.append(path)
        pending.extend(f"{path}/{child}" for child in client.get_children(path))
    return found


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
    with pytest.raises(InvalidSpec, match="CASQUE_ZOOKEEPER_ACL"):
        zk.connect(bare, namespace=A.namespace)
    # Even with a derivation key, as if they were the installation's: ZooKeeper says they are not.
    with pytest.raises(AccessDenied, match="CASQUE_ZOOKEEPER_ACL"):
        zk.connect(bare.model_copy(update={"derivation_key": SecretStr(KEY)}), namespace=A.namespace)


def test_every_znode_the_operator_creates_carries_the_policys_acl(operator_store: Store) -> None:
    policy = installation_policy(ROOT, [INSTALLATION], [KEY])
    reader = namespace_identity(INSTALLATION.username, KEY, A.namespace).acl_id
    assert_acls_follow(operator_store.zk, policy)
    namespace_acl, _ = operator_store.zk.get_acls(f"{ROOT}/queues/{A.namespace}")
    assert {(e.perms, e.id) for e in namespace_acl} == {(Permissions.ALL, INSTALLATION.acl_id),
                                                        (Permissions.READ, reader)}


def assert_acls_follow(client: KazooClient, policy: Any, under: Sequence[str] = (ROOT,)) -> int:
    """Walk the installation (or the subtrees `under`) and check every znode's ACL against
    the policy; the count walked."""
    walked = 0
    pending = list(under)
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

    # A second sidecar of the namespace: both consumer groups form, the leased subscriber's
    # two shards spread over the two members.
    start_sidecar("--queue", A.name, "--subscriber", "billing", "--subscriber", "pool", env=env_of(A.namespace))
    billing = operator_store.paths(A).subscriber("billing")
    pool = operator_store.paths(A).subscriber("pool")

    def lease_holders() -> set[bytes] | None:
        try:
            held = {operator_store.zk.get(f"{billing.leases}/{shard}")[0]
                    for shard in operator_store.zk.get_children(billing.leases)}
        except NoNodeError:
            return None  # a lease handed over meanwhile
        return held if len(held) == 2 else None

    wait_for("billing's shards leased by both sidecars", lease_holders)
    wait_for("both sidecars members of the pool", lambda: len(operator_store.zk.get_children(pool.members)) == 2)

    # Members, leases, fences, cursors, claims, seek records, the mover's election: all
    # made by the sidecars, walked while they still run (their ephemeral znodes exist).
    # The pool's open range (five messages received, not acked) is on either shard.
    assert any(operator_store.zk.exists(pool.claims(s)) and operator_store.zk.get_children(pool.claims(s))
               for s in (0, 1)), "no claim of the pool to check"
    assert assert_acls_follow(operator_store.zk, installation_policy(ROOT, [INSTALLATION], [KEY])) > 30


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
    assert namespace_identity(INSTALLATION.username, KEY, A.namespace).password not in sidecar.tail(20000)


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
    # The operator's reconciles leave open znodes alone: sidecars without credentials still
    # serve the namespace until its pods restart with the Secret, and this command runs.
    assert namespace_setup.secure_namespace_znodes(lambda: secured, A.namespace) == 0
    a.set(legacy.paths(A).subscriber("billing").offset(0), b"1")
    assert catalog.secure_znodes(secured) > 10
    # The administrators' command, run again: nothing left to change.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CASQUE_")},
           "CASQUE_CASSANDRA_CONTACT_POINTS": ",".join(backends.contact_points),
           "CASQUE_CASSANDRA_PORT": str(backends.cql_port), "CASQUE_KEYSPACE": keyspace,
           "CASQUE_ZOOKEEPER_HOSTS": zk_hosts, "CASQUE_ZOOKEEPER_ROOT": ROOT,
           "CASQUE_ZOOKEEPER_USERNAME": INSTALLATION.username, "CASQUE_ZOOKEEPER_PASSWORD": INSTALLATION.password,
           "CASQUE_DERIVATION_KEY": KEY}
    again = subprocess.run([sys.executable, "-m", "casque.cli", "secure-znodes"], env=env, capture_output=True,
                           text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "0 znodes of the installation given their ACL"
    assert_acls_follow(admin, installation_policy(ROOT, [INSTALLATION], [KEY]))
    with pytest.raises(NoAuthError):
        a.set(legacy.paths(B).subscriber("billing").offset(0), b"1")
    with pytest.raises(NoAuthError):
        open_client.get(legacy.paths(A).base)  # no identity at all: nothing


def test_rotating_the_installation_password_keeps_the_namespaces_identities_and_refuses_the_old_password(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    new = ROTATED
    rotating = settings(zk_hosts, new).model_copy(update={
        "zookeeper_previous_password": SecretStr(INSTALLATION.password)})
    during = zk.connect(rotating)
    clients.append(during)
    store = Store(operator_store.session, during, operator_store.keyspace, ROOT, REPLICATION)
    assert catalog.secure_znodes(store) > 10
    offset = store.paths(A).subscriber("billing").offset(0)
    old_operator = zk.connect(settings(zk_hosts, INSTALLATION))
    clients.append(old_operator)
    old_sidecar = connect_as(zk_hosts, A.namespace, clients)
    # The namespace's identity is derived from the key, not the password: the Secret written
    # during the rotation names the same identity, with an ACL naming both installation identities.
    new_sidecar = zk.connect(namespace_settings(zk_hosts, A.namespace, (new, INSTALLATION)), namespace=A.namespace)
    clients.append(new_sidecar)
    old_operator.set(offset, b"1")
    old_sidecar.set(offset, b"2")
    new_sidecar.set(offset, b"3")

    after = zk.connect(settings(zk_hosts, new))  # the previous password dropped
    clients.append(after)
    assert catalog.secure_znodes(Store(operator_store.session, after, operator_store.keyspace, ROOT, REPLICATION)) > 10
    new_sidecar.set(offset, b"4")
    old_sidecar.set(offset, b"5")
    with pytest.raises(NoAuthError):
        old_operator.set(offset, b"6")


def assert_serves_its_subscriber(client: KazooClient, store: Store, member: str) -> None:
    """What a sidecar does with its namespace's znodes: read the queue (and its grant), move
    its subscriber's offset, register a member."""
    paths = store.paths(A).subscriber("billing")
    assert catalog.read_queue(Store(store.session, client, store.keyspace, ROOT, REPLICATION), A).spec.shards == 2
    client.set(paths.offset(0), b"7")
    client.create(paths.member(member), b"{}", ephemeral=True)


def assert_refused_everywhere(client: KazooClient, store: Store, member: str) -> None:
    paths = store.paths(A).subscriber("billing")
    for refused in (lambda: client.get(paths.base), lambda: client.set(paths.offset(0), b"9"),
                    lambda: client.create(paths.member(member), b"{}", ephemeral=True),
                    lambda: client.get(store.paths(A).grant)):
        with pytest.raises(NoAuthError):
            refused()


def test_a_new_derivation_key_gives_the_namespace_a_new_identity_and_the_old_one_is_refused(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    """Rotating the derivation key: the operator, restarted with the new key, finds the
    namespace's Secret out of date on its next reconcile, gives the namespace's znodes the
    ACL of the new identity and writes the new Secret; from then on ZooKeeper refuses the
    old identity, and the new one works."""
    old = secret_settings(zk_hosts, settings(zk_hosts, INSTALLATION), A.namespace)
    old_sidecar = zk.connect(old, namespace=A.namespace)
    clients.append(old_sidecar)
    assert_serves_its_subscriber(old_sidecar, operator_store, "before")
    rotated = settings(zk_hosts, INSTALLATION, key=NEW_KEY)
    new = secret_settings(zk_hosts, rotated, A.namespace)
    assert new.zookeeper_username == old.zookeeper_username and new.zookeeper_password != old.zookeeper_password
    with pytest.raises(AccessDenied):
        zk.connect(new, namespace=A.namespace)  # the ACLs still name the old key's identity

    restarted = zk.connect(rotated)
    clients.append(restarted)
    store = Store(operator_store.session, restarted, operator_store.keyspace, ROOT, REPLICATION)
    assert namespace_setup.secure_namespace_znodes(lambda: store, A.namespace) > 5  # the reconcile's step

    new_sidecar = zk.connect(new, namespace=A.namespace)
    clients.append(new_sidecar)
    assert_serves_its_subscriber(new_sidecar, operator_store, "after")
    assert_refused_everywhere(old_sidecar, operator_store, "stale")
    with pytest.raises(AccessDenied):
        zk.connect(old, namespace=A.namespace)
    # B is untouched until its own reconcile: each namespace's identity rotates with its Secret.
    b = zk.connect(secret_settings(zk_hosts, settings(zk_hosts, INSTALLATION), B.namespace), namespace=B.namespace)
    clients.append(b)
    b.set(operator_store.paths(B).subscriber("billing").offset(0), b"2")
    # Nothing but the namespace's znodes changed, and they follow the new key's policy.
    assert_acls_follow(restarted, installation_policy(ROOT, [INSTALLATION], [NEW_KEY]), under=[
        f"{ROOT}/queues/{A.namespace}", f"{ROOT}/grants/{A.namespace}"])


def test_while_the_derivation_key_rotates_both_identities_work_until_the_previous_key_is_dropped(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    """With CASQUE_PREVIOUS_DERIVATION_KEY the ACLs name both keys' identities, so sidecars
    still holding the old Secret keep working until the app pods restart."""
    old_sidecar = zk.connect(secret_settings(zk_hosts, settings(zk_hosts, INSTALLATION), A.namespace),
                             namespace=A.namespace)
    clients.append(old_sidecar)
    during = settings(zk_hosts, INSTALLATION, key=NEW_KEY, previous_key=KEY)
    operator = zk.connect(during)
    clients.append(operator)
    store = Store(operator_store.session, operator, operator_store.keyspace, ROOT, REPLICATION)
    assert namespace_setup.secure_namespace_znodes(lambda: store, A.namespace) > 5
    new_sidecar = zk.connect(secret_settings(zk_hosts, during, A.namespace), namespace=A.namespace)
    clients.append(new_sidecar)
    assert_serves_its_subscriber(old_sidecar, operator_store, "old")
    assert_serves_its_subscriber(new_sidecar, operator_store, "new")

    after = settings(zk_hosts, INSTALLATION, key=NEW_KEY)  # the previous key dropped
    operator = zk.connect(after)
    clients.append(operator)
    store = Store(operator_store.session, operator, operator_store.keyspace, ROOT, REPLICATION)
    assert namespace_setup.secure_namespace_znodes(lambda: store, A.namespace) > 5
    assert_serves_its_subscriber(new_sidecar, operator_store, "new-again")
    assert_refused_everywhere(old_sidecar, operator_store, "old-again")


def test_a_znode_a_namespace_locked_to_itself_is_named_and_the_walk_goes_on_past_it(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    """On a ZooKeeper whose superuser the installation's login is not (this session's server;
    the chart's and the dev stack's make it one, test_zookeeper_sasl), a namespace creates a
    znode naming only itself. `secure-znodes` cannot touch it: it gives every other znode its
    ACL (here one of the other namespace's, set open) and then names the one it could not.
    Before, it stopped at the first NoAuth, leaving what came after it as it was."""
    own = namespace_settings(zk_hosts, A.namespace)
    assert own.zookeeper_password is not None
    a = KazooClient(hosts=zk_hosts,
                    auth_data=[("digest", f"{own.zookeeper_username}:{own.zookeeper_password.get_secret_value()}")])
    a.start(timeout=15)
    clients.append(a)
    only_itself = [ACL(Permissions.ALL, namespace_identity(INSTALLATION.username, KEY, A.namespace).acl_id)]
    locked = operator_store.paths(A).subscriber("billing").member("locked")
    a.create(locked, b"", acl=only_itself)
    drifted = operator_store.paths(B).subscriber("billing").offset(1)
    operator_store.zk.set_acls(drifted, OPEN_ACL_UNSAFE)
    try:
        with pytest.raises(AccessDenied) as refused:
            catalog.secure_znodes(operator_store)
        assert f"refused the installation on 1 (with what is below them): {locked};" in str(refused.value)
        policy = installation_policy(ROOT, [INSTALLATION], [KEY])
        assert set(operator_store.zk.get_acls(drifted)[0]) == set(policy.acl_for(drifted))
    finally:
        a.delete(locked)  # the tenant's to remove: the test's cleanup could not


def count_znodes(client: KazooClient, top: str) -> int:
    """`top` and every znode below it."""
    return 1 + sum(count_znodes(client, f"{top}/{child}") for child in client.get_children(top))


def count_bytes(client: KazooClient, top: str) -> int:
    """The data of `top` and of every znode below it, as ZooKeeper's quota counts it."""
    return len(client.get(top)[0] or b"") + sum(count_bytes(client, f"{top}/{child}")
                                                for child in client.get_children(top))


def test_a_namespace_creates_no_znode_past_its_quota_and_cannot_touch_the_quota(
    operator_store: Store, zk_hosts: str, clients: list[KazooClient]
) -> None:
    """A tenant with its namespace's credentials creates znodes in its members container
    until the ensemble every namespace shares runs out of memory. With `max-znodes` and
    `max-znode-bytes` the operator sets ZooKeeper's hard quota on the namespace's znode: the
    tenant is refused past either (casque's own calls say `quota_exceeded`), another
    namespace is not held back, and the tenant can neither change its quota nor set one on
    another namespace, nor reopen /zookeeper/quota. Before quotas, every one of those creates
    and writes was accepted."""
    installation = settings(zk_hosts, INSTALLATION)
    servers, chroot = znode_quotas.split_chroot(zk_hosts)
    own, other = f"{ROOT}/queues/{A.namespace}", f"{ROOT}/queues/{B.namespace}"
    room, spare_bytes = 4, 100
    quota = znode_quotas.ZnodeQuota(max_znodes=count_znodes(operator_store.zk, own) + room,
                                    max_bytes=count_bytes(operator_store.zk, own) + spare_bytes)
    changed = namespace_setup.apply_znode_quota(lambda: operator_store, installation, A.namespace, quota)
    admin = zk.connect(installation, hosts=servers)  # where the quotas are, outside the chroot
    clients.append(admin)
    try:
        assert changed, "a quota set and /zookeeper/quota closed"
        assert not namespace_setup.apply_znode_quota(lambda: operator_store, installation, A.namespace, quota)

        tenant = connect_as(zk_hosts, A.namespace, clients)
        members = operator_store.paths(A).subscriber("billing")
        # Bytes first, while the count has room: one znode with more data than is left.
        with pytest.raises(QuotaExceededError):
            tenant.create(members.member("large"), b"x" * (spare_bytes + 1), ephemeral=True)
        tenant.create(members.member("m0"), b"{}", ephemeral=True)
        with pytest.raises(QuotaExceeded, match="max-znode-bytes"):
            asyncio.run(zk.call(tenant.set_async, members.member("m0"), b"x" * (spare_bytes + 1)))
        for index in range(1, room):
            tenant.create(members.member(f"m{index}"), b"{}", ephemeral=True)
        with pytest.raises(QuotaExceededError):
            tenant.create(members.member("one-more"), b"{}", ephemeral=True)
        with pytest.raises(QuotaExceeded, match="max-znodes"):
            asyncio.run(zk.call(tenant.create_async, members.member("one-more"), b"{}", ephemeral=True))

        neighbour = connect_as(zk_hosts, B.namespace, clients)
        for index in range(room + 2):
            neighbour.create(operator_store.paths(B).subscriber("billing").member(f"m{index}"), b"{}", ephemeral=True)

        identity = namespace_identity(INSTALLATION.username, KEY, A.namespace)
        outside = KazooClient(hosts=servers, auth_data=[identity.auth])
        outside.start(timeout=15)
        clients.append(outside)
        limits = f"{znode_quotas.quota_path(chroot, own)}/{znode_quotas.LIMITS_NODE}"
        for refused in (
            lambda: outside.set(limits, znode_quotas.limits_data(znode_quotas.ZnodeQuota(max_znodes=10**9))),
            lambda: outside.delete(limits),
            lambda: outside.create(f"{znode_quotas.quota_path(chroot, other)}/{znode_quotas.LIMITS_NODE}",
                                   znode_quotas.limits_data(znode_quotas.ZnodeQuota(max_znodes=1)), makepath=True),
            lambda: outside.set_acls(znode_quotas.QUOTA_ROOT, OPEN_ACL_UNSAFE),
        ):
            with pytest.raises(NoAuthError):
                refused()

        # Lifted: the namespace creates again.
        assert namespace_setup.apply_znode_quota(lambda: operator_store, installation, A.namespace,
                                                 znode_quotas.ZnodeQuota())
        tenant.create(members.member("one-more"), b"{}", ephemeral=True)
    finally:
        # The session's ZooKeeper serves other tests' installations: /zookeeper/quota open again.
        with contextlib.suppress(NoNodeError):
            admin.delete(znode_quotas.quota_path(chroot, own), recursive=True)
        admin.set_acls(znode_quotas.QUOTA_ROOT, OPEN_ACL_UNSAFE)
