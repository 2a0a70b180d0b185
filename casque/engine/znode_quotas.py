"""A namespace's bound on znodes and their bytes: ZooKeeper's hard quota on the namespace's subtree.

Every znode a namespace's sidecars may create lies below `{root}/queues/<ns>`
(casque.backends.zkacl), so a hard quota there bounds what one namespace can put into the
ensemble that every namespace shares. Without one, a tenant holding its namespace's
credentials could create znodes below its members or claims containers until the servers'
memory ran out, for every namespace at once.

ZooKeeper keeps a quota as znodes under `/zookeeper/quota/<path>`: `zookeeper_limits`
(the limits) and `zookeeper_stats`, whose creation makes the server count the subtree. It
refuses a create past a hard limit (`QuotaExceededError`) only on servers started with
`-Dzookeeper.enforceQuota=true`; the local stack and the chart's image set it, and an
ensemble of your own needs it. The count includes the namespace's own znode; the bytes are
the sum of the subtree's data (names and ACLs are not counted).

`/zookeeper/quota` is open to anyone out of the box: a tenant could lift its own limit, or
lower another namespace's to nothing. So setting a quota first gives `/zookeeper/quota` the
installation's ACL, anyone reading.

A chroot in the connect string is the client's business, so the quota's path is the
server's: the chroot, then the installation's path.
"""

from __future__ import annotations

from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NodeExistsError, NoNodeError

from casque.backends import ensemble_acl
from casque.errors import AccessDenied

QUOTA_ROOT = ensemble_acl.QUOTA_ROOT
LIMITS_NODE = "zookeeper_limits"
STATS_NODE = "zookeeper_stats"


@dataclass(frozen=True)
class ZnodeQuota:
    """A namespace's hard limits in ZooKeeper; None: that one unbounded."""

    max_znodes: int | None = None
    max_bytes: int | None = None

    @property
    def unbounded(self) -> bool:
        return self.max_znodes is None and self.max_bytes is None

    def describe(self) -> str:
        """The quota in a few words, for events: `at most 100000 znodes, 67108864 bytes`."""
        bounds = [f"{limit} {unit}" for limit, unit in ((self.max_znodes, "znodes"), (self.max_bytes, "bytes"))
                  if limit is not None]
        return f"at most {', '.join(bounds)}" if bounds else "lifted"


def limits_data(quota: ZnodeQuota) -> bytes:
    """The limits a `setquota -N ... -B ...` would write: hard limits and no soft ones
    (ZooKeeper only logs those); -1 is none."""
    count = -1 if quota.max_znodes is None else quota.max_znodes
    size = -1 if quota.max_bytes is None else quota.max_bytes
    return f"count=-1,bytes=-1,countHardLimit={count},byteHardLimit={size}".encode()


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
    return ensemble_acl.close(client, QUOTA_ROOT, "which namespace quotas need closed")


def apply_quota(client: KazooClient, chroot: str, path: str, quota: ZnodeQuota) -> bool:
    """Make the hard quota on `path` (a namespace's znode) `quota` (none if unbounded);
    whether anything changed. `client` is the installation's, without a chroot."""
    where = quota_path(chroot, path)
    try:
        return _apply(client, f"{where}/{LIMITS_NODE}", f"{where}/{STATS_NODE}", quota)
    except NoAuthError as error:
        raise AccessDenied(f"ZooKeeper refused the installation the quota of {path} under {QUOTA_ROOT}: another "
                           "login closed it (docs/security.md)") from error


def _apply(client: KazooClient, limits: str, stats: str, quota: ZnodeQuota) -> bool:
    if quota.unbounded:
        changed = False
        for node in (stats, limits):
            try:
                client.delete(node)
                changed = True
            except NoNodeError:
                pass
        return changed
    closed = close_quota_root(client)
    wanted = limits_data(quota)
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
