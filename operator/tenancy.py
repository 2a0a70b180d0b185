"""A namespace's ZooKeeper identity, handed to it in a Secret.

With ZooKeeper credentials in the operator's settings, the first Queue of a
namespace gets the namespace a Secret `casque-zookeeper` holding the namespace's digest
identity (casque.backends.zkacl) and the ACL its sidecars put on what they create. The
injected sidecar reads that Secret, so a pod holds its own namespace's credentials and never
the installation's. The Secret is derived from the operator's settings, so it is simply
written again (never read back) when it differs, e.g. after a password rotation.
"""

from __future__ import annotations

import base64
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from casque.backends import zk
from casque.backends.zkacl import format_acl, installation_policy, namespace_identity
from casque.config import Settings
from casque.operator.injection import ZOOKEEPER_SECRET as ZOOKEEPER_SECRET  # one name, where the webhook reads it

USERNAME_KEY, PASSWORD_KEY, ACL_KEY = "username", "password", "acl"
MANAGED_BY = {"app.kubernetes.io/managed-by": "casque-operator"}


def zookeeper_secret(settings: Settings, namespace: str) -> dict[str, Any] | None:
    """The Secret for `namespace`'s sidecars; None when ZooKeeper runs without authentication."""
    installation = zk.identities(settings)
    if not installation:
        return None
    identity = namespace_identity(installation[0], namespace)
    # While a rotation is under way the ACL names the previous password's identities too, so
    # sidecars started now create znodes that the operator can still reach on either side.
    acl = installation_policy(settings.zookeeper_root, installation).descendant_acl(namespace)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": ZOOKEEPER_SECRET, "namespace": namespace, "labels": dict(MANAGED_BY)},
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in (
            (USERNAME_KEY, identity.username), (PASSWORD_KEY, identity.password), (ACL_KEY, format_acl(acl)))},
    }


def apply_zookeeper_secret(api: client.ApiClient, settings: Settings, namespace: str) -> bool:
    """Create or correct the namespace's Secret (blocking). True if it was written."""
    wanted = zookeeper_secret(settings, namespace)
    if wanted is None:
        return False
    core = client.CoreV1Api(api)
    try:
        core.create_namespaced_secret(namespace, wanted)  # type: ignore[arg-type]  # the client takes a dict too
        return True
    except ApiException as error:
        # 409: it exists (written for another Queue, maybe by a reconcile running now).
        if error.status != 409:
            raise
    current = core.read_namespaced_secret(ZOOKEEPER_SECRET, namespace)
    if (current.data or {}) == wanted["data"]:
        return False
    core.patch_namespaced_secret(ZOOKEEPER_SECRET, namespace, {"data": wanted["data"]})
    return True


def delete_zookeeper_secret(api: client.ApiClient, namespace: str) -> bool:
    """Remove the namespace's Secret (its last Queue is gone). True if there was one."""
    try:
        client.CoreV1Api(api).delete_namespaced_secret(ZOOKEEPER_SECRET, namespace)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True
