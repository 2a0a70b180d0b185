"""A namespace's bound on znodes: ZooKeeper's hard quota on the namespace's subtree.

Every znode a namespace's sidecars may create lies below `{root}/queues/<ns>`
(casque.backends.zkacl), so a hard quota there bounds what one namespace can put into the
ensemble that every namespace shares. Without one, a tenant holding its namespace's
credentials could create znodes below its members or claims containers until the servers'
memory ran out, for every namespace at once.

ZooKeeper keeps a quota as znodes under `/zookeeper/quota/<path>`: `zookeeper_limits`
(the limits) and `zookeeper_stats`, whose creation makes the server count the subtree. It
refuses a create past a hard limit (`QuotaExceededError`) only on servers started with
`-Dzookeeper.enforceQuota=true`; the local stack and the chart's image set it, and an
ensemble of your own needs it. The count includes the namespace's own znode.

`/zookeeper/quota` is open to anyone out of the box: a tenant could lift its own limit, or
lower another namespace's to nothing. So setting a quota first gives `/zookeeper/quota` the
installation's ACL, anyone reading.

A chroot in the connect string is the client's business, so the quota's path is the
server's: the chroot, then the installation's path.
"""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NodeExistsError, NoNodeError
from kazoo.security import ACL, ANYONE_ID_UNSAFE, Permissions

from casque.errors import AccessDenied

QUOTA_ROOT = "/zookeeper/quota"
LIMITS_NODE = "zookeeper_limits"
STATS_NODE = "zookeeper_stats"


def limits_data(max_znodes: int) -> bytes:
    """The limits a `setquota -N` would write: a hard count and no soft limits (ZooKeeper
    only logs those). Bytes are not bounded yet: each znode's data is, by the servers'
    `jute.maxbuffer` (1 MiB)."""
    return f"count=-1,bytes=-1,countHardLimit={max_znodes},byteHardLimit=-1".encode()


def split_chroot(hosts: str) -> tuple[str, str]:
    """(the servers, the chroot or "") of a connect string such as `a:2181,b:2181/casque`."""
    servers, slash, chroot = hosts.partition("/")
    return servers, (slash + chroot).rstrip("/") if chroot else ""


def quota_path(chroot: str, path: str) -> str:
    """Where ZooKeeper keeps the quota of `path` as a client under `chroot` names it."""
    return f"{QUOTA_ROOT}{chroot}{path}"


def close_quota_root(client: KazooClient) -> bool:
    """Give `/zookeeper/quota` the installation's ACL (anyone may read) if anyone else may
    write it; whether it changed. `client` is the installation's, without a chroot."""
    policy = getattr(client, "acl_policy", None)
    if policy is None:
        return False  # an installation without ZooKeeper credentials has nothing to close it with
    wanted = [*policy.installation_acl, ACL(Permissions.READ, ANYONE_ID_UNSAFE)]
    current, stat = client.get_acls(QUOTA_ROOT)
    if set(current) == set(wanted):
        return False
    try:
        client.set_acls(QUOTA_ROOT, wanted, version=stat.aversion)
    except NoAuthError as error:
        raise AccessDenied(f"ZooKeeper refused the installation the ACL of {QUOTA_ROOT}, which namespace quotas "
                           "need closed: give its login ZooKeeper's superuser (docs/security.md)") from error
    return True


def apply_quota(client: KazooClient, chroot: str, path: str, max_znodes: int | None) -> bool:
    """Make the hard quota on `path` (a namespace's znode) `max_znodes`, or none; whether
    anything changed. `client` is the installation's, without a chroot."""
    quota = quota_path(chroot, path)
    try:
        return _apply(client, f"{quota}/{LIMITS_NODE}", f"{quota}/{STATS_NODE}", max_znodes)
    except NoAuthError as error:
        raise AccessDenied(f"ZooKeeper refused the installation the quota of {path} under {QUOTA_ROOT}: another "
                           "login closed it (docs/security.md)") from error


def _apply(client: KazooClient, limits: str, stats: str, max_znodes: int | None) -> bool:
    if max_znodes is None:
        changed = False
        for node in (stats, limits):
            try:
                client.delete(node)
                changed = True
            except NoNodeError:
                pass
        return changed
    closed = close_quota_root(client)
    wanted = limits_data(max_znodes)
    try:
        data, _ = client.get(limits)
    except NoNodeError:
        data = None
        client.create(limits, wanted, makepath=True)
    else:
        if data != wanted:
            client.set(limits, wanted)
    try:
        # After the limits: its creation makes the server count what the namespace has.
        client.create(stats, b"count=0,bytes=0")
    except NodeExistsError:
        pass
    return closed or data != wanted
