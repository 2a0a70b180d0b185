"""Copies of the installation's sidecar Secrets in every namespace that uses casque.

Without Cassandra keyspace isolation an injected sidecar reads the installation's Cassandra
credentials (`CASQUE_INJECTION_CREDENTIALS_SECRET`), and with TLS the backends' CA and client
certificate (`CASQUE_INJECTION_CASSANDRA_TLS_SECRET`, `_ZOOKEEPER_TLS_SECRET`), from Secrets of
those names in its own namespace: a Pod can only refer to Secrets of its own namespace. The
operator keeps a copy of each, read from its own namespace (the source), in every namespace
with a Queue and every namespace the webhook injects a sidecar into.

A copy is always `Opaque` (the sidecar mounts keys, whatever the source's type; and the
chart's admission policy lets the operator write nothing else), carries the operator's
`managed-by` label and an annotation naming its source. A Secret of the same name without
that label is the user's: the operator never writes over it, and says so.

Copies stay when a namespace's last Queue goes: the operator may not list Pods, so it cannot
tell whether injected pods still read them, and a copy deleted under a running pod would stop
its sidecar's next start (the kubelet resolves the Secret on every container start). A copy
holds nothing those pods do not already hold; it goes with its namespace or by hand.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from casque.config import Settings
from casque.operator.injection import ANNOTATION_PREFIX, TLS_CA_KEY, TLS_CERT_KEY, TLS_KEY_KEY, InjectionSettings
from casque.operator.tenancy import MANAGED_BY

log = logging.getLogger(__name__)

# On every copy: where it was copied from, `<namespace>/<name>`.
SOURCE_ANNOTATION = f"{ANNOTATION_PREFIX}copied-from"

Action = Literal["create", "update", "unchanged", "unmanaged"]


def source_names(settings: InjectionSettings, backends: Settings) -> list[str]:
    """The Secrets an injected sidecar reads by these names in its own namespace: the ones to copy."""
    names: list[str] = []
    if settings.credentials_secret is not None and backends.cassandra_isolation != "keyspace":
        # With keyspace isolation the sidecar reads its namespace's role instead (tenancy.py).
        names.append(settings.credentials_secret)
    if settings.cassandra_tls_secret is not None and backends.cassandra_tls.enabled:
        names.append(settings.cassandra_tls_secret)
    if settings.zookeeper_tls_secret is not None and backends.zookeeper_tls.enabled:
        names.append(settings.zookeeper_tls_secret)
    return list(dict.fromkeys(names))


def copied_keys(settings: InjectionSettings, backends: Settings) -> dict[str, frozenset[str]]:
    """The sources whose copy keeps only some of their keys, with those keys: a TLS Secret's
    copy holds what the sidecar mounts of it, the CA, and the client's certificate and key
    only when the backend asks for one. The source may hold more: the chart's certificate
    for an embedded backend keeps the server's key beside the CA, and that key must never
    reach an app's namespace. Other sources (the shared credentials) are copied whole."""
    keys: dict[str, frozenset[str]] = {}
    for name, tls in ((settings.cassandra_tls_secret, backends.cassandra_tls),
                      (settings.zookeeper_tls_secret, backends.zookeeper_tls)):
        if name is None or not tls.enabled:
            continue
        client_files = {TLS_CERT_KEY, TLS_KEY_KEY} if tls.cert_file is not None else set()
        keys[name] = keys.get(name, frozenset()) | {TLS_CA_KEY, *client_files}
    if settings.credentials_secret in source_names(settings, backends):
        keys.pop(settings.credentials_secret, None)
    return keys


def kept(source: dict[str, Any], keys: frozenset[str] | None) -> dict[str, Any]:
    """`source` with only `keys` of its data (all of it for None)."""
    if keys is None:
        return source
    return {**source, "data": {key: value for key, value in (source.get("data") or {}).items() if key in keys}}


def wanted_copy(source: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """The copy of `source` (a Secret as the API serialises it) for `namespace`."""
    metadata = source["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": metadata["name"],
            "namespace": namespace,
            "labels": dict(MANAGED_BY),
            "annotations": {SOURCE_ANNOTATION: f"{metadata['namespace']}/{metadata['name']}"},
        },
        "data": dict(source.get("data") or {}),
    }


def is_managed(secret: Mapping[str, Any]) -> bool:
    labels = (secret.get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in MANAGED_BY.items())


def decide(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> Action:
    """What to do about one copy, given the Secret of its name found in its namespace (or None)."""
    if current is None:
        return "create"
    if not is_managed(current):
        return "unmanaged"
    annotations = (current.get("metadata") or {}).get("annotations") or {}
    if (current.get("data") or {}) == wanted["data"] and \
            annotations.get(SOURCE_ANNOTATION) == wanted["metadata"]["annotations"][SOURCE_ANNOTATION]:
        return "unchanged"
    return "update"


def update_patch(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch that makes `current` hold `wanted`'s data: keys the source dropped are removed."""
    data: dict[str, Any] = {key: None for key in current.get("data") or {} if key not in wanted["data"]}
    data.update(wanted["data"])
    return {"metadata": {"annotations": dict(wanted["metadata"]["annotations"])}, "data": data}


@dataclass
class CopyReport:
    """What one pass over a namespace did."""

    namespace: str
    written: list[str] = field(default_factory=list)
    # Secrets of a copy's name that the operator does not manage: left as they are.
    unmanaged: list[str] = field(default_factory=list)
    # Sources missing from the operator's namespace: nothing to copy yet.
    missing: list[str] = field(default_factory=list)

    def warnings(self) -> list[str]:
        found = [f"Secret {name} exists in namespace {self.namespace} without the label "
                 f"app.kubernetes.io/managed-by=casque-operator: left as it is, not replaced by the operator's "
                 f"copy; delete it to let the operator keep a copy there, or keep it up to date yourself"
                 for name in self.unmanaged]
        found += [f"Secret {name} is missing from the operator's namespace: sidecars here cannot read it "
                  f"until it exists there" for name in self.missing]
        return found


def read_sources(api: client.ApiClient, namespace: str, names: Sequence[str],
                 keys: Mapping[str, frozenset[str]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The source Secrets that exist (serialised, with only the `keys` of `copied_keys`) and
    the names that do not (blocking)."""
    core = client.CoreV1Api(api)
    found: list[dict[str, Any]] = []
    missing: list[str] = []
    for name in names:
        secret = _read(api, core, name, namespace)
        if secret is None:
            missing.append(name)
        else:
            found.append(kept(secret, keys.get(name)))
    return found, missing


Mode = Literal["all", "create", "update"]


def copy_into(api: client.ApiClient, sources: Sequence[Mapping[str, Any]], namespace: str,
              mode: Mode = "all") -> CopyReport:
    """Make `namespace`'s copies of `sources` current (blocking). `mode`: "all" creates and
    corrects; "create" only makes missing copies (the webhook's fast path: the leader corrects
    the others); "update" only corrects copies that exist (a rotation reaching namespaces that
    had copies but hold no Queue now)."""
    report = CopyReport(namespace)
    core = client.CoreV1Api(api)
    for source in sources:
        if source["metadata"]["namespace"] == namespace:
            continue  # the source itself
        wanted = wanted_copy(source, namespace)
        name = wanted["metadata"]["name"]
        current = None if mode == "create" else _read(api, core, name, namespace)
        action = decide(current, wanted)
        if mode == "update" and action in ("create", "unmanaged"):
            continue  # a namespace without a Queue: only copies the operator made are its business
        if action == "create":
            try:
                core.create_namespaced_secret(namespace, wanted)  # type: ignore[arg-type]  # a dict will do
                report.written.append(name)
                continue
            except ApiException as error:
                # 409: it exists, made since the read (by a Queue's reconcile, or a webhook).
                if error.status != 409:
                    raise
            current = _read(api, core, name, namespace)
            action = decide(current, wanted)
            if mode == "create" and action == "update":
                action = "unchanged"  # the leader's reconcile corrects it
        if action == "unmanaged":
            report.unmanaged.append(name)
        elif action == "update" and current is not None:
            core.patch_namespaced_secret(name, namespace, update_patch(current, wanted))
            report.written.append(name)
    return report


def _read(api: client.ApiClient, core: client.CoreV1Api, name: str, namespace: str) -> dict[str, Any] | None:
    try:
        secret = core.read_namespaced_secret(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    serialised: dict[str, Any] = api.sanitize_for_serialization(secret)  # type: ignore[no-untyped-call]
    return serialised


class WebhookCopier:
    """The webhook's part: after answering with a sidecar, make the pod's namespace's missing
    copies in the background.

    The answer never waits for it: the API server gives the webhook a few seconds in all and
    a Secret read or write can be slow, while the pod does not need the copy yet (the kubelet
    waits for a Secret a container refers to, and retries). Only missing copies are made,
    with a create that fails harmlessly if one exists, so any replica may do it, leader or
    not; correcting a stale copy is the leader's (its reconcile reads and compares). One pass
    per namespace at a time: a Deployment scaled to 100 pods makes one.
    """

    def __init__(self, api: Callable[[], client.ApiClient], source_namespace: str, names: Sequence[str],
                 keys: Mapping[str, frozenset[str]]) -> None:
        self._make_api = api
        self._client: client.ApiClient | None = None
        self._lock = threading.Lock()
        self._source_namespace = source_namespace
        self._names = list(names)
        self._keys = dict(keys)
        self._running: dict[str, asyncio.Task[None]] = {}

    def schedule(self, namespace: str) -> None:
        if not self._names or namespace == self._source_namespace or namespace in self._running:
            return
        task = asyncio.get_running_loop().create_task(self._copy(namespace), name=f"copies-{namespace}")
        self._running[namespace] = task
        task.add_done_callback(lambda _: self._running.pop(namespace, None))

    async def wait(self) -> None:
        """Until the passes under way are done (for tests and a clean stop)."""
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def _copy(self, namespace: str) -> None:
        try:
            report = await asyncio.to_thread(self.copy, namespace)
        except ApiException as error:
            log.warning("could not copy the sidecar's Secrets into namespace %s: Kubernetes API answered %s %s",
                        namespace, error.status, error.reason)
            return
        if report.written:
            log.info("copied %s into namespace %s for an injected pod", ", ".join(report.written), namespace)
        for problem in report.warnings():
            log.warning("%s", problem)

    def _api(self) -> client.ApiClient:
        with self._lock:  # called from worker threads
            if self._client is None:
                self._client = self._make_api()
            return self._client

    def copy(self, namespace: str) -> CopyReport:
        api = self._api()
        found, missing = read_sources(api, self._source_namespace, self._names, self._keys)
        report = copy_into(api, found, namespace, mode="create")
        report.missing = missing
        return report
