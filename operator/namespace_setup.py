"""The backends the flows act on: the installation opened on first use (`StoreSource`), and
what a namespace needs in Cassandra and ZooKeeper before its Secrets name its identities.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cassandra import Unauthorized
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.security import ANYONE_ID_UNSAFE

from casque.backends import ensemble_acl, zk
from casque.config import Settings
from casque.engine import catalog, znode_quotas
from casque.engine.znode_quotas import ZnodeQuota
from casque.errors import AccessDenied
from casque.operator.failures import backend_errors
from casque.store import Store
from casque.tenancy import NamespaceRole
from casque.znodes import queues_root

# Something that hands out the Store, opening it on first use. Flows that may not need the
# backends at all (deleting a Queue whose policy is Retain) call it only when they must.
StoreSource = Callable[[], Store]


def open_store(settings: Settings) -> Store:
    """Connect to the backends of `settings` and make sure the installation exists."""
    with backend_errors():
        store = Store.open(settings)
        try:
            catalog.ensure_installation(store)
        except BaseException:
            store.close()
            raise
    return store


def prepare_namespace_cassandra(stores: StoreSource, namespace: str, role: NamespaceRole,
                                publishing: bool = True) -> None:
    """Keyspace isolation: the namespace's keyspace with its shared tables, and its role
    (blocking), writing only what its consumers write unless `publishing` (its stored-bytes
    quota, casque.operator.storage_quota). Before the namespace's Secret names the role, so
    no sidecar is handed a login that does not exist yet."""
    with backend_errors():
        store = stores()
        try:
            catalog.ensure_namespace_keyspace(store, namespace)
            catalog.ensure_namespace_role(store, role, publishing)
        except Unauthorized as error:
            raise AccessDenied(
                f"the operator's Cassandra role may not prepare namespace {namespace} (it needs CREATE and "
                f"AUTHORIZE on all keyspaces and CREATE on all roles, or superuser): {error}"
            ) from error


def secure_namespace_znodes(stores: StoreSource, namespace: str) -> int:
    """Give the namespace's znodes the ACL of the current identities (blocking): before its
    ZooKeeper Secret names a new identity. Returns how many changed.

    Not while the namespace's znodes are open (an installation that ran without ZooKeeper
    authentication): its running sidecars hold no credentials yet, and securing waits for
    the administrators' `casque secure-znodes`, once they do (docs/security.md).
    """
    with backend_errors():
        store = stores()
        try:
            acl, _ = store.zk.get_acls(f"{queues_root(store.zk_root)}/{namespace}")
        except NoNodeError:
            return 0  # its first Queue: nothing made yet
        if any(entry.id == ANYONE_ID_UNSAFE for entry in acl):
            return 0
        return catalog.secure_znodes(store, namespace)


def apply_znode_quota(stores: StoreSource, settings: Settings, namespace: str, quota: ZnodeQuota) -> bool:
    """Make the namespace's hard quota in ZooKeeper `quota` (blocking); whether it changed."""
    path = f"{queues_root(settings.zookeeper_root)}/{namespace}"
    with backend_errors(), _unchrooted(stores, settings) as (client, chroot):
        return znode_quotas.apply_quota(client, chroot, path, quota)


def close_owned_ensemble(stores: StoreSource, settings: Settings) -> list[str]:
    """On an ensemble the installation owns (`zookeeper_owned_ensemble`), close `/`,
    `/zookeeper` and `/zookeeper/quota` to every other login (blocking); the paths that
    changed. Before any Secret: no namespace holds an identity while they are open."""
    if not settings.zookeeper_owned_ensemble:
        return []
    with backend_errors(), _unchrooted(stores, settings) as (client, _):
        return ensemble_acl.close_owned_ensemble(client)


@contextmanager
def _unchrooted(stores: StoreSource, settings: Settings) -> Iterator[tuple[KazooClient, str]]:
    """The installation's ZooKeeper client without a chroot, and the chroot of its settings:
    ZooKeeper's own znodes and quotas live outside any chroot, so under one a client of its
    own (closed afterwards) reaches them."""
    servers, chroot = znode_quotas.split_chroot(settings.zookeeper_hosts)
    if not chroot:
        yield stores().zk, ""
        return
    client = zk.connect(settings, hosts=servers)
    try:
        yield client, chroot
    finally:
        client.stop()
        client.close()


def forget_namespace_cassandra(stores: StoreSource, role: NamespaceRole) -> None:
    """The namespace's last Queue is gone: its role goes, its keyspace stays (blocking)."""
    with backend_errors():
        catalog.drop_namespace_role(stores(), role)
