"""ZooKeeper's own znodes closed to everyone but the installation: `/`, `/zookeeper` and
`/zookeeper/quota`.

A fresh ensemble gives all three to anyone (`world:anyone:cdrwa`), a client without a login
included: it may create znodes at the root without bound (no namespace quota covers them),
take ADMIN on `/`, or rewrite every quota. Closed, they keep the installation's ACL and let
anyone read, which is all a client needs (listing `/`, reading `/zookeeper/config`).

`/zookeeper/quota` is closed wherever casque sets a quota (casque.engine.znode_quotas). `/`
and `/zookeeper` only on an ensemble the installation owns (`CASQUE_ZOOKEEPER_OWNED_ENSEMBLE`:
the chart's embedded one, `casque dev up --secure`): on a shared ensemble other
applications create their own top-level znodes.
"""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import ACL, ANYONE_ID_UNSAFE, Permissions

from casque.errors import AccessDenied

ROOT = "/"
SYSTEM = "/zookeeper"
QUOTA_ROOT = "/zookeeper/quota"
OWNED_ENSEMBLE_PATHS = (ROOT, SYSTEM, QUOTA_ROOT)


def closed_acl(installation_acl: tuple[ACL, ...] | list[ACL]) -> list[ACL]:
    """The ACL of a closed znode: the installation's, and anyone may read."""
    return [*installation_acl, ACL(Permissions.READ, ANYONE_ID_UNSAFE)]


def close(client: KazooClient, path: str, why: str) -> bool:
    """Give `path` the closed ACL unless it has it; whether it changed. `client` is the
    installation's, without a chroot; one without ZooKeeper credentials changes nothing
    (it would close the znode to itself). `why` ends the error if the servers refuse."""
    policy = getattr(client, "acl_policy", None)
    if policy is None:
        return False
    wanted = closed_acl(policy.installation_acl)
    current, stat = client.get_acls(path)
    if set(current) == set(wanted):
        return False
    try:
        client.set_acls(path, wanted, version=stat.aversion)
    except NoAuthError as error:
        raise AccessDenied(f"ZooKeeper refused the installation the ACL of {path}, {why}: give its login "
                           "ZooKeeper's superuser (docs/security.md)") from error
    return True


def close_owned_ensemble(client: KazooClient) -> list[str]:
    """Close `/`, `/zookeeper` and `/zookeeper/quota` of an ensemble the installation owns;
    the paths that changed."""
    return [path for path in OWNED_ENSEMBLE_PATHS
            if close(client, path, "which an ensemble of the installation's own keeps closed")]
