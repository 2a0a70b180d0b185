"""The installation identity over SASL DIGEST-MD5, on the real ZooKeeper of `secure_stack`
(a JAAS `Server` section with the installation user, `authProvider.sasl`, TLS with client
certificates), next to the namespaces' digest identities.

The operator's Store logs in over SASL and every znode it creates names it as `sasl:<user>`;
a wrong SASL password is refused at connect with `AccessDenied` (not a hang), and neither a
client without a login nor a digest login with the installation's own username and password
reaches anything; a namespace's digest identity, from the Secret the operator would write,
still works inside its namespace and nowhere else; the operator's functions (reconcile,
observe, secure-znodes, the CLI's too) work over SASL.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NoNodeError
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Id, Permissions
from pydantic import SecretStr

from casque.backends import zk
from casque.backends.ensemble_acl import close_owned_ensemble
from casque.backends.zkacl import AclPolicy, Identity, installation_policy, namespace_identity
from casque.config import CassandraTlsSettings, Settings, ZooKeeperTlsSettings
from casque.devstack.stack import Stack
from casque.engine import catalog
from casque.errors import AccessDenied
from casque.operator import namespace_setup, observation
from casque.operator.tenancy import zookeeper_secret
from casque.schema import SCHEMA_CHANGE_TIMEOUT_SECONDS, QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.stack import chroot_on

ROOT = "/sasl"
A = QueueRef("team-a", "orders")
B = QueueRef("team-b", "orders")
KEY = "derivation-key-for-sasl-tests-0123456789"


@pytest.fixture
def login(secure_stack: Stack) -> Identity:
    """The installation user the stack's JAAS file holds."""
    sasl = secure_stack.zookeeper_sasl_login
    assert sasl is not None
    return Identity(sasl.username, sasl.password(), "sasl")


@pytest.fixture
def zk_hosts(secure_stack: Stack) -> Iterator[str]:
    hosts = secure_stack.zookeeper_tls_hosts
    assert hosts is not None
    with chroot_on(hosts, **secure_stack.zookeeper_client_options()) as chrooted:
        yield chrooted


@pytest.fixture
def settings(secure_stack: Stack, zk_hosts: str, login: Identity) -> Iterator[Settings]:
    """The operator's settings: `dev up --tls --tls-client-auth --auth --zookeeper-sasl`, for one test."""
    pki = secure_stack.pki
    assert pki is not None
    files = {"enabled": True, "ca_file": pki.ca_crt, "cert_file": pki.client_crt, "key_file": pki.client_key}
    keyspace = f"t_{uuid.uuid4().hex[:16]}"
    cassandra_login = secure_stack.cassandra_login
    assert cassandra_login is not None
    operator = Settings(
        cassandra_contact_points=secure_stack.contact_points, cassandra_port=secure_stack.ports.native,
        cassandra_username=cassandra_login.username, cassandra_password=SecretStr(cassandra_login.password()),
        cassandra_tls=CassandraTlsSettings(**files), zookeeper_tls=ZooKeeperTlsSettings(**files),
        zookeeper_hosts=zk_hosts, zookeeper_root=ROOT, keyspace=keyspace, consistency="ONE",
        zookeeper_username=login.username, zookeeper_password=SecretStr(login.password), zookeeper_sasl=True,
        derivation_key=SecretStr(KEY), zookeeper_session_timeout_seconds=5,
    )
    yield operator
    # The chroot's own cleanup has no login: the installation removes what only it may.
    admin = zk.connect(operator)
    try:
        admin.delete(ROOT, recursive=True)
    except NoNodeError:
        pass
    finally:
        admin.stop()
        admin.close()
    cleanup = Store.open(operator.model_copy(update={"zookeeper_username": None, "zookeeper_password": None,
                                                     "zookeeper_sasl": False}))
    try:
        cleanup.session.execute(f"DROP KEYSPACE IF EXISTS {keyspace}", timeout=SCHEMA_CHANGE_TIMEOUT_SECONDS)
    finally:
        cleanup.close()


@pytest.fixture
def operator_store(settings: Settings) -> Iterator[Store]:
    """The operator's Store (opened as the operator opens it), with both namespaces' queues."""
    store = namespace_setup.open_store(settings)
    try:
        for ref in (A, B):
            catalog.apply_queue(store, ref, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE"))
            catalog.apply_subscriber(store, ref, "billing", SubscriberSpec(queue=ref.name, start_position="earliest"))
        yield store
    finally:
        store.close()


@pytest.fixture
def clients() -> Iterator[list[KazooClient]]:
    opened: list[KazooClient] = []
    yield opened
    for client in opened:
        client.stop()
        client.close()


def policy_of(login: Identity) -> AclPolicy:
    return installation_policy(ROOT, [login], [KEY])


def walk(client: KazooClient, policy: AclPolicy) -> list[str]:
    """Every znode of the installation, each checked against the policy."""
    walked = []
    pending = [ROOT]
    while pending:
        path = pending.pop()
        try:
            acl, _ = client.get_acls(path)
            children = client.get_children(path)
        except NoNodeError:
            continue  # an ephemeral znode gone meanwhile
        assert set(acl) == set(policy.acl_for(path)), path
        walked.append(path)
        pending.extend(f"{path}/{child}" for child in children)
    return walked


def namespace_settings(operator: Settings, namespace: str) -> Settings:
    """A namespace's sidecar settings, from the Secret the operator writes for it."""
    secret = zookeeper_secret(operator, namespace)
    assert secret is not None
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    return operator.model_copy(update={
        "zookeeper_username": data["username"], "zookeeper_password": SecretStr(data["password"]),
        "zookeeper_acl": data["acl"], "zookeeper_sasl": False, "zookeeper_previous_password": None,
        "derivation_key": None})


def test_the_installation_logs_in_over_sasl_and_its_znodes_name_it_as_a_sasl_user(
    operator_store: Store, login: Identity
) -> None:
    assert operator_store.zk.use_ssl  # SASL inside TLS
    installation = ACL(Permissions.ALL, Id("sasl", login.username))
    root_acl, _ = operator_store.zk.get_acls(ROOT)
    assert root_acl == [installation]
    namespace_acl, _ = operator_store.zk.get_acls(f"{ROOT}/queues/{A.namespace}")
    reader = namespace_identity(login.username, KEY, A.namespace)
    assert reader.scheme == "digest"
    assert set(namespace_acl) == {installation, ACL(Permissions.READ, reader.acl_id)}
    walked = walk(operator_store.zk, policy_of(login))
    assert len(walked) > 10
    # No digest entry names the installation: its password is in no ACL.
    for path in walked:
        acl, _ = operator_store.zk.get_acls(path)
        assert not [e for e in acl if e.id.scheme == "digest" and e.id.id.startswith(f"{login.username}:")], path


def test_a_wrong_sasl_password_is_refused_at_connect_and_no_login_reaches_nothing(
    operator_store: Store, settings: Settings, login: Identity, clients: list[KazooClient]
) -> None:
    wrong = settings.model_copy(update={"zookeeper_password": SecretStr("w" * 40)})
    with pytest.raises(AccessDenied, match="refused the SASL DIGEST-MD5 login of user 'casque'") as refused:
        zk.connect(wrong)
    assert "w" * 40 not in str(refused.value) and login.password not in str(refused.value)
    with pytest.raises(AccessDenied, match="refused the SASL"):
        Store.open(wrong)  # the Cassandra session it opened first is closed again

    queues = f"{ROOT}/queues"
    anonymous = zk.connect(settings.model_copy(update={"zookeeper_username": None, "zookeeper_password": None,
                                                       "zookeeper_sasl": False}))
    clients.append(anonymous)
    # The installation's username and password as a digest login: ZooKeeper takes any digest,
    # and no ACL names this one.
    as_digest = zk.connect(settings.model_copy(update={"zookeeper_sasl": False}))
    clients.append(as_digest)
    for outsider in (anonymous, as_digest):
        for refused_call in (lambda: outsider.get_children(queues), lambda: outsider.get(operator_store.paths(A).base),
                             lambda: outsider.create(f"{ROOT}/intruder", b"")):
            with pytest.raises(NoAuthError):
                refused_call()
    # A sidecar started with those (the installation's settings without SASL) stops at connect.
    with pytest.raises(AccessDenied, match="not the installation's"):
        zk.connect(settings.model_copy(update={"zookeeper_sasl": False}), namespace=A.namespace)


def test_a_namespaces_digest_identity_works_in_its_namespace_only(
    operator_store: Store, settings: Settings, login: Identity, clients: list[KazooClient]
) -> None:
    own = operator_store.paths(A).subscriber("billing")
    other = operator_store.paths(B).subscriber("billing")
    a_settings = namespace_settings(settings, A.namespace)
    a = zk.connect(a_settings, namespace=A.namespace)  # what a sidecar's Store.open does
    clients.append(a)

    a.get(own.base)
    a.set(own.offset(0), b"5")
    a.create(own.member("m1"), b"{}", ephemeral=True)
    member_acl, _ = operator_store.zk.get_acls(own.member("m1"))
    assert set(member_acl) == set(policy_of(login).acl_for(own.member("m1")))  # the sasl entry included
    for refused_call in (lambda: a.get(other.offset(0)), lambda: a.set(other.offset(0), b"9"),
                         lambda: a.get_children(f"{ROOT}/queues/{B.namespace}"),
                         lambda: a.create(f"{ROOT}/queues/team-c", b""),
                         lambda: a.set_acls(own.offset(0), OPEN_ACL_UNSAFE)):
        with pytest.raises(NoAuthError):
            refused_call()
    with pytest.raises(AccessDenied, match="another namespace"):
        zk.connect(a_settings, namespace=B.namespace)
    assert operator_store.zk.get(own.offset(0))[0] == b"5"


async def test_the_operators_functions_work_over_sasl(
    operator_store: Store, settings: Settings, secure_stack: Stack, login: Identity, clients: list[KazooClient]
) -> None:
    a = zk.connect(namespace_settings(settings, A.namespace), namespace=A.namespace)
    clients.append(a)
    a.create(operator_store.paths(A).subscriber("billing").member("m1"), b"{}", ephemeral=True)

    catalog.apply_queue(operator_store, B, QueueSpec(shards=3, retention_seconds=3600, consistency="ONE"))
    assert operator_store.zk.get(operator_store.paths(B).subscriber("billing").offset(2))[0] == b"1"
    seen = await observation.observe_queue(operator_store, B, figures=False)
    assert seen.stored is not None and seen.stored.shards == 3 and set(seen.heads) == {0, 1, 2}
    assert catalog.delete_subscriber(operator_store, A, "billing").changed  # A's sidecar's member included
    assert catalog.delete_queue(operator_store, A, "Delete").changed

    # secure-znodes puts the policy's ACL back where it differs, as the operator and as the CLI.
    opened = operator_store.paths(B).subscriber("billing").offset(0)
    operator_store.zk.set_acls(opened, OPEN_ACL_UNSAFE)
    assert catalog.secure_znodes(operator_store) == 1
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CASQUE_")}, **secure_stack.client_env(),
           "CASQUE_ZOOKEEPER_HOSTS": settings.zookeeper_hosts, "CASQUE_ZOOKEEPER_ROOT": ROOT,
           "CASQUE_KEYSPACE": settings.keyspace, "CASQUE_DERIVATION_KEY": KEY}
    assert env["CASQUE_ZOOKEEPER_SASL"] == "true"
    operator_store.zk.set_acls(opened, OPEN_ACL_UNSAFE)
    cli = subprocess.run([sys.executable, "-m", "casque.cli", "secure-znodes"], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == "1 znode of the installation given their ACL"
    assert login.password not in cli.stdout + cli.stderr
    walk(operator_store.zk, policy_of(login))


def test_a_znode_a_namespace_locked_to_itself_is_still_secured_and_deleted_by_the_installation(
    operator_store: Store, settings: Settings, login: Identity, clients: list[KazooClient]
) -> None:
    """A namespace may create znodes in the containers its sidecars write to, and ZooKeeper lets
    a creator choose their ACL: here one naming only the namespace (ADMIN included), with a
    child. The installation's login is the servers' superuser, so `secure-znodes` still gives
    them the policy's ACL and deleting the queue still removes them. Before, both stopped at the
    first NoAuth: the operator was locked out of the tenant's queue, and a rotation left the
    other namespaces' znodes after it with their old ACL."""
    # The tenant's own client, with its namespace's credentials: casque's would put the
    # policy's ACL on what it creates.
    own = namespace_settings(settings, A.namespace)
    assert own.zookeeper_password is not None
    a = KazooClient(hosts=own.zookeeper_hosts, **zk.tls_options(own),
                    auth_data=[("digest", f"{own.zookeeper_username}:{own.zookeeper_password.get_secret_value()}")])
    a.start(timeout=30)
    clients.append(a)
    tenant = namespace_identity(login.username, KEY, A.namespace)
    only_itself = [ACL(Permissions.ALL, tenant.acl_id)]
    locked = operator_store.paths(A).subscriber("billing").member("locked")
    a.create(locked, b"", acl=only_itself)
    a.create(f"{locked}/child", b"", acl=only_itself)
    assert operator_store.zk.get_acls(locked)[0] == only_itself

    assert catalog.secure_znodes(operator_store) >= 2
    for path in (locked, f"{locked}/child"):
        assert set(operator_store.zk.get_acls(path)[0]) == set(policy_of(login).acl_for(path)), path

    # Locked again, deeper: what the namespace may create it may still lock.
    a.create(f"{locked}/again", b"", acl=only_itself)
    a.create(f"{locked}/again/deeper", b"", acl=only_itself)
    catalog.delete_queue(operator_store, A, "Delete")
    assert operator_store.zk.exists(operator_store.paths(A).base) is None
    assert operator_store.zk.exists(operator_store.paths(B).base) is not None


def test_zookeepers_own_znodes_are_closed_to_every_login_but_the_installations(
    secure_stack: Stack, settings: Settings, login: Identity, operator_store: Store, clients: list[KazooClient]
) -> None:
    """`/`, `/zookeeper` and `/zookeeper/quota` of a fresh ensemble are open to anyone, a client
    with no login included: unbounded znodes at the root (outside every namespace's quota),
    ADMIN on `/`, quotas rewritten. The stack's ensemble is the installation's own, as the
    chart's embedded one is, so `up` closes them: a client with no login and a namespace's
    identity may read them and nothing else; the installation still creates at the root."""
    servers = secure_stack.zookeeper_tls_hosts
    assert servers is not None
    anonymous = KazooClient(hosts=servers, **secure_stack.zookeeper().client_options())
    anonymous.start(timeout=30)
    clients.append(anonymous)
    own = namespace_settings(settings, A.namespace)
    assert own.zookeeper_password is not None
    tenant = KazooClient(hosts=servers, **zk.tls_options(own),
                         auth_data=[("digest", f"{own.zookeeper_username}:{own.zookeeper_password.get_secret_value()}")])
    tenant.start(timeout=30)
    clients.append(tenant)
    probe = f"/intruder-{uuid.uuid4().hex[:8]}"
    for outsider in (anonymous, tenant):
        assert outsider.get_children("/") and outsider.get_children("/zookeeper")  # reading stays open
        for refused_call in (lambda: outsider.create(probe, b""),
                             lambda: outsider.create(f"/zookeeper{probe}", b""),
                             lambda: outsider.create(f"/zookeeper/quota{probe}", b""),
                             lambda: outsider.set_acls("/", OPEN_ACL_UNSAFE),
                             lambda: outsider.set_acls("/zookeeper", OPEN_ACL_UNSAFE),
                             lambda: outsider.set("/", b"taken")):
            with pytest.raises(NoAuthError):
                refused_call()

    installation = zk.connect(settings.model_copy(update={"zookeeper_hosts": servers}))
    clients.append(installation)
    closed = [ACL(Permissions.ALL, Id("sasl", login.username)), ACL(Permissions.READ, Id("world", "anyone"))]
    for path in ("/", "/zookeeper", "/zookeeper/quota"):
        assert set(installation.get_acls(path)[0]) == set(closed), path
    installation.create(probe, b"")
    installation.delete(probe)
    # A second `up` (the stack is running) finds them closed and changes nothing.
    assert not close_owned_ensemble(installation)
