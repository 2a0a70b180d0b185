"""A namespace's backend identities, handed to it in Secrets.

With ZooKeeper credentials in the operator's settings, the first Queue of a
namespace gets the namespace a Secret `casque-zookeeper` holding the namespace's digest
identity (casque.backends.zkacl) and the ACL its sidecars put on what they create. With
Cassandra keyspace isolation (`CASQUE_CASSANDRA_ISOLATION=keyspace`), a Secret
`casque-cassandra-role` holds the namespace's Cassandra role and keyspace (casque.tenancy).
The injected sidecar reads those Secrets, so a pod holds its own namespace's credentials
and never the installation's. The Secrets are derived from the operator's settings (the
passwords from the derivation key, casque.derivation), so they are simply written again
when they differ, e.g. after a rotation of the derivation key or of the ZooKeeper password.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from casque.backends import zk
from casque.backends.zkacl import format_acl, installation_policy, namespace_identity
from casque.config import Settings
from casque.errors import InvalidSpec
from casque.operator.injection import (  # one name each, where the webhook reads them
    CASSANDRA_SECRET as CASSANDRA_SECRET,
    ZOOKEEPER_SECRET as ZOOKEEPER_SECRET,
)
from casque.tenancy import NamespaceRole, namespace_role

USERNAME_KEY, PASSWORD_KEY, ACL_KEY, KEYSPACE_KEY = "username", "password", "acl", "keyspace"
MANAGED_BY = {"app.kubernetes.io/managed-by": "casque-operator"}


def zookeeper_secret(settings: Settings, namespace: str) -> dict[str, Any] | None:
    """The Secret for `namespace`'s sidecars; None when ZooKeeper runs without authentication."""
    installation = zk.identities(settings)
    if not installation:
        return None
    keys = settings.derivation_keys()
    if not keys:
        # Settings refuse this; a copy made without validation (model_copy) could not.
        raise InvalidSpec("the installation's ZooKeeper credentials need CASQUE_DERIVATION_KEY")
    identity = namespace_identity(installation[0].username, keys[0], namespace)
    # While a rotation is under way the ACL names the previous password's and the previous
    # key's identities too, so sidecars started now create znodes that the operator and the
    # sidecars still holding the previous identity can reach.
    acl = installation_policy(settings.zookeeper_root, installation, keys).descendant_acl(namespace)
    return _secret(ZOOKEEPER_SECRET, namespace, {
        USERNAME_KEY: identity.username, PASSWORD_KEY: identity.password, ACL_KEY: format_acl(acl)})


def cassandra_role(settings: Settings, namespace: str) -> NamespaceRole | None:
    """`namespace`'s Cassandra role; None without keyspace isolation."""
    if settings.cassandra_isolation != "keyspace":
        return None
    if settings.derivation_key is None:
        # Settings refuse this; a copy made without validation (model_copy) could not.
        raise InvalidSpec("CASQUE_CASSANDRA_ISOLATION=keyspace needs CASQUE_DERIVATION_KEY")
    return namespace_role(settings.keyspace, settings.derivation_key.get_secret_value(), namespace)


def cassandra_secret(settings: Settings, namespace: str) -> dict[str, Any] | None:
    """The Secret with `namespace`'s Cassandra role; None without keyspace isolation."""
    role = cassandra_role(settings, namespace)
    if role is None:
        return None
    return _secret(CASSANDRA_SECRET, namespace, {
        USERNAME_KEY: role.username, PASSWORD_KEY: role.password, KEYSPACE_KEY: role.keyspace})


def _secret(name: str, namespace: str, values: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)},
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in values.items()},
    }


def apply_zookeeper_secret(
    api: client.ApiClient, settings: Settings, namespace: str, secure_znodes: Callable[[], object]
) -> bool:
    """Create or correct the namespace's ZooKeeper Secret (blocking). True if it was written.

    When the Secret is out of date (a new derivation key or installation password changed
    the identity or its ACL), `secure_znodes` first gives every znode of the namespace the
    ACL of the current identities: the new identity then reaches them, and an identity no
    longer in the settings is refused from then on. The znodes before the Secret: should the
    operator stop between the two, the next reconcile still finds the Secret out of date
    and walks them again.
    """
    wanted = zookeeper_secret(settings, namespace)
    if wanted is None or secret_is_current(api, wanted):
        return False
    secure_znodes()
    return apply_secret(api, wanted)


def apply_cassandra_secret(api: client.ApiClient, settings: Settings, namespace: str) -> bool:
    """Create or correct the namespace's Cassandra Secret (blocking). True if it was written."""
    return apply_secret(api, cassandra_secret(settings, namespace))


def secret_is_current(api: client.ApiClient, wanted: dict[str, Any]) -> bool:
    """Whether the Secret exists with the data of `wanted` (blocking)."""
    try:
        metadata = wanted["metadata"]
        current = client.CoreV1Api(api).read_namespaced_secret(metadata["name"], metadata["namespace"])
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return bool((current.data or {}) == wanted["data"])


def apply_secret(api: client.ApiClient, wanted: dict[str, Any] | None) -> bool:
    """Create or correct a Secret (blocking); None wants none. True if it was written."""
    if wanted is None:
        return False
    name, namespace = wanted["metadata"]["name"], wanted["metadata"]["namespace"]
    core = client.CoreV1Api(api)
    try:
        core.create_namespaced_secret(namespace, wanted)  # type: ignore[arg-type]  # the client takes a dict too
        return True
    except ApiException as error:
        # 409: it exists (written for another Queue, maybe by a reconcile running now).
        if error.status != 409:
            raise
    current = core.read_namespaced_secret(name, namespace)
    if (current.data or {}) == wanted["data"]:
        return False
    core.patch_namespaced_secret(name, namespace, {"data": wanted["data"]})
    return True


def delete_zookeeper_secret(api: client.ApiClient, namespace: str) -> bool:
    """Remove the namespace's ZooKeeper Secret (its last Queue is gone). True if there was one."""
    return delete_secret(api, ZOOKEEPER_SECRET, namespace)


def delete_cassandra_secret(api: client.ApiClient, namespace: str) -> bool:
    """Remove the namespace's Cassandra Secret (its last Queue is gone). True if there was one."""
    return delete_secret(api, CASSANDRA_SECRET, namespace)


def delete_secret(api: client.ApiClient, name: str, namespace: str) -> bool:
    try:
        client.CoreV1Api(api).delete_namespaced_secret(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True
