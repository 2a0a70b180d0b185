"""The operator against a real kube-apiserver, Cassandra and ZooKeeper.

Each test runs `casque operator run` as a subprocess in a namespace of its own, with a
keyspace and a ZooKeeper root of its own, and watches what it does to the backends and to
the resources' status. Waits poll with a bounded timeout; nothing is timed.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from cassandra.cluster import Session
from kazoo.client import KazooClient
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from casque.devstack.kube import KubeCluster
from casque.engine import catalog
from casque.engine.messages import OutgoingMessage
from casque.engine.publisher import Publisher
from casque.operator.resources import FINALIZER, GROUP, QUEUES, SUBSCRIBERS, VERSION
from casque.schema import QueueRef, drop_messages_table_ddl, read_table_options
from casque.store import Store
from tests.fixtures.kube import kube_tool
from tests.fixtures.stack import Backends, drop_keyspace
from tests.fixtures.waiting import refused_port, reserved_port, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CRD_FILES = [ROOT / "crds" / "queue.yaml", ROOT / "crds" / "subscriber.yaml"]
# A refusal for a quota retried only after an hour: what lets a Queue in within a test is the
# change that made room, as it happens.
NO_QUOTA_RETRY = {"CASQUE_OPERATOR_QUOTA_RETRY_SECONDS": "3600"}






# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def casque_crds(kube_client: client.ApiClient) -> None:  # noqa: F811
    """The CRDs from crds/, created (or replaced) and Established."""
    import yaml

    api = client.ApiextensionsV1Api(kube_client)
    for path in CRD_FILES:
        crd = yaml.safe_load(path.read_text())
        name = crd["metadata"]["name"]
        try:
            current = api.read_custom_resource_definition(name)
            crd["metadata"]["resourceVersion"] = current.metadata.resource_version
            api.replace_custom_resource_definition(name, crd)
        except ApiException as error:
            if error.status != 404:
                raise
            api.create_custom_resource_definition(crd)

        def established(name: str = name) -> bool:
            conditions = api.read_custom_resource_definition(name).status.conditions or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        wait_for(f"CRD {name} to be Established", established)


@dataclass
class Backend:
    """Where one test's operator keeps its data, and a Store to look at it."""

    keyspace: str
    zk_root: str
    env: dict[str, str]
    store: Store


@pytest.fixture
def backend(backends: Backends, cql: Session, kube_cluster: KubeCluster) -> Iterator[Backend]:  # noqa: F811
    suffix = uuid.uuid4().hex[:12]
    keyspace, top = f"op_{suffix}", f"/op-{suffix}"
    zk = KazooClient(hosts=backends.zookeeper_hosts)
    zk.start(timeout=15)
    store = Store(
        session=cql,
        zk=zk,
        keyspace=keyspace,
        zk_root=f"{top}/casque",
        replication_cql="{'class': 'SimpleStrategy', 'replication_factor': 1}",
    )
    env = {
        **os.environ,
        "KUBECONFIG": str(kube_cluster.kubeconfig_path),
        "CASQUE_CASSANDRA_CONTACT_POINTS": ",".join(backends.contact_points),
        "CASQUE_CASSANDRA_PORT": str(backends.cql_port),
        "CASQUE_ZOOKEEPER_HOSTS": backends.zookeeper_hosts,
        "CASQUE_KEYSPACE": keyspace,
        "CASQUE_ZOOKEEPER_ROOT": store.zk_root,
        "CASQUE_CONSISTENCY": "ONE",
        # Refresh status every second, so that tests see the timer's work quickly.
        "CASQUE_OPERATOR_REFRESH_INTERVAL": "1",
    }
    try:
        yield Backend(keyspace, store.zk_root, env, store)
    finally:
        drop_keyspace(cql, keyspace)
        zk.delete(top, recursive=True)
        zk.stop()
        zk.close()


class Operator:
    """One `casque operator run` subprocess serving one namespace."""

    def __init__(self, env: dict[str, str], namespace: str, log: Path, *args: str) -> None:
        self.port = reserved_port()
        self.log_path = log
        command = [
            sys.executable, "-m", "casque.cli", "operator", "run",
            "--namespace", namespace,
            "--liveness", f"http://127.0.0.1:{self.port}/healthz",
            "--lease-namespace", namespace,
            # Short Lease timings so that a takeover happens within seconds.
            "--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5",
            *args,
        ]  # fmt: skip
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def liveness(self) -> tuple[int, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as response:
                return int(response.status), json.loads(response.read())
        except urllib.error.HTTPError as error:
            return int(error.code), None
        except OSError:
            return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.alive():
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@pytest.fixture
def operators(
    backend: Backend,
    kube_namespace: str,  # noqa: F811
    kube_client: client.ApiClient,  # noqa: F811
    casque_crds: None,
    tmp_path: Path,
) -> Iterator[Callable[..., Operator]]:
    """Start operators for this test's namespace; at the end, delete its resources first."""
    started: list[Operator] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Operator:
        operator = Operator(env or backend.env, kube_namespace, tmp_path / f"operator-{len(started)}.log", *args)
        started.append(operator)
        return operator

    try:
        yield start
    finally:
        # Custom resources go before the namespace, while an operator can still release
        # their finalizers.
        if not any(o.alive() for o in started):
            start()
        api = client.CustomObjectsApi(kube_client)
        for plural in (SUBSCRIBERS, QUEUES):
            for item in api.list_namespaced_custom_object(GROUP, VERSION, kube_namespace, plural)["items"]:
                delete(api, kube_namespace, plural, item["metadata"]["name"])
        try:
            # A deadline, not a figure: on a loaded machine kopf's retries of a deletion
            # that met a busy API server take minutes, and a teardown is not what is tested.
            wait_for("the test's resources to be deleted", lambda: not _remaining(api, kube_namespace), timeout=300)
        finally:
            _strip_finalizers(api, kube_namespace)
            for operator in started:
                operator.stop()
                print(f"--- {operator.log_path.name}\n{operator.log()[-6000:]}")


def _remaining(api: client.CustomObjectsApi, namespace: str) -> list[str]:
    return [
        item["metadata"]["name"]
        for plural in (SUBSCRIBERS, QUEUES)
        for item in api.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)["items"]
    ]


def _strip_finalizers(api: client.CustomObjectsApi, namespace: str) -> None:
    for plural in (SUBSCRIBERS, QUEUES):
        for item in api.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)["items"]:
            api.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, plural, item["metadata"]["name"], {"metadata": {"finalizers": None}}
            )


# --- helpers ------------------------------------------------------------------------------


def queue(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Queue", "metadata": {"name": name}, "spec": spec}


def subscriber(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Subscriber", "metadata": {"name": name}, "spec": spec}


def create(api: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    plural = QUEUES if body["kind"] == "Queue" else SUBSCRIBERS
    created: dict[str, Any] = api.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)
    return created


def get(api: client.CustomObjectsApi, namespace: str, plural: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = api.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        return found
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def patch_spec(api: client.CustomObjectsApi, namespace: str, plural: str, name: str, **spec: Any) -> dict[str, Any]:
    patched: dict[str, Any] = api.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, plural, name, {"spec": spec}
    )
    return patched


def delete(api: client.CustomObjectsApi, namespace: str, plural: str, name: str) -> None:
    try:
        api.delete_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
    except ApiException as error:
        if error.status != 404:
            raise


def condition_of(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for condition in ((obj or {}).get("status") or {}).get("conditions") or []:
        if condition["type"] == kind:
            return dict(condition)
    return {}


def ready_of(obj: dict[str, Any] | None) -> dict[str, Any]:
    return condition_of(obj, "Ready")


def wait_ready(
    api: client.CustomObjectsApi,
    namespace: str,
    plural: str,
    name: str,
    *,
    status: str = "True",
    reason: str | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """The object once its Ready condition judges its current generation as `status` (and `reason`)."""

    def probe() -> dict[str, Any] | None:
        obj = get(api, namespace, plural, name)
        condition = ready_of(obj)
        if (
            obj is not None
            and condition.get("observedGeneration") == obj["metadata"]["generation"]
            and condition.get("status") == status
            and (reason is None or condition.get("reason") == reason)
        ):
            return obj
        return None

    return wait_for(f"{plural}/{name} Ready={status} {reason or ''}", probe, timeout)


def refused(call: Callable[[], object]) -> str:
    """The message of the 422 the API server answers `call` with."""
    with pytest.raises(ApiException) as error:
        call()
    assert error.value.status == 422, error.value.body
    return str(json.loads(error.value.body)["message"])


def events(kube_client: client.ApiClient, namespace: str, name: str) -> list[tuple[str, str, str]]:  # noqa: F811
    listed = client.CoreV1Api(kube_client).list_namespaced_event(namespace)
    return [(e.type, e.reason, e.message) for e in listed.items if e.involved_object.name == name]


def table_ttl(backend: Backend, name: str, namespace: str) -> int | None:
    options = read_table_options(backend.store.session, backend.keyspace, QueueRef(namespace, name))
    return options.default_time_to_live if options.exists else None


def heads(backend: Backend, ref: QueueRef) -> list[str]:
    path = backend.store.paths(ref).shards
    return sorted(backend.store.zk.get_children(path)) if backend.store.zk.exists(path) else []


# --- the API server refuses bad specs -----------------------------------------------------


def test_the_api_server_refuses_invalid_specs(
    kube_client: client.ApiClient, kube_namespace: str, casque_crds: None  # noqa: F811
) -> None:
    """The CEL rules at work; no operator is needed for the API server to refuse these."""
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace

    assert "shards must be at least 1" in refused(lambda: create(api, ns, queue("zero", shards=0)))
    assert "retention must be at least 60s" in refused(lambda: create(api, ns, queue("brief", retention="30s")))
    assert "retention must be at least 60s" in refused(lambda: create(api, ns, queue("brief", retention=59)))
    assert "retention must be seconds or a number" in refused(lambda: create(api, ns, queue("odd", retention="7w")))
    assert "defaultDelay must be shorter than retention" in refused(
        lambda: create(api, ns, queue("late", retention="1h", defaultDelay="2h"))
    )
    assert "must be a DNS label" in refused(lambda: create(api, ns, queue("orders.v2")))

    created = create(api, ns, queue("orders", shards=4))
    assert created["spec"] == {
        "shards": 4,
        "retention": "7d",
        "maxMessageBytes": 262144,
        "priorities": 1,
        "defaultDelay": 0,
        "consistency": "LOCAL_QUORUM",
        "deletionPolicy": "Retain",
        "schemaCompatibility": "backward",
    }
    assert "shards cannot be lowered" in refused(lambda: patch_spec(api, ns, QUEUES, "orders", shards=2))
    patch_spec(api, ns, QUEUES, "orders", shards=6)  # growing is fine

    assert "deadLetterQueue must be another queue" in refused(
        lambda: create(api, ns, subscriber("loop", queue="orders", deadLetterQueue="orders"))
    )
    assert "startPosition must be earliest, latest or an RFC 3339 time" in refused(
        lambda: create(api, ns, subscriber("when", queue="orders", startPosition="yesterday"))
    )
    assert "visibilityTimeout must be between 1s and 12h" in refused(
        lambda: create(api, ns, subscriber("slow", queue="orders", visibilityTimeout="13h"))
    )
    assert "stallAfter must be between 1s and 7d" in refused(
        lambda: create(api, ns, subscriber("patient", queue="orders", stallAfter="8d"))
    )
    assert "stallAfter must be seconds or a number" in refused(
        lambda: create(api, ns, subscriber("patient", queue="orders", stallAfter="soon"))
    )
    assert "retry.minimumBackoff must be between 0s and 12h" in refused(
        lambda: create(api, ns, subscriber("eager", queue="orders", retry={"minimumBackoff": -1}))
    )
    assert "retry.maximumBackoff must be between 0s and 12h" in refused(
        lambda: create(api, ns, subscriber("eager", queue="orders", retry={"maximumBackoff": "13h"}))
    )
    assert "retry.maximumBackoff must be seconds or a number" in refused(
        lambda: create(api, ns, subscriber("eager", queue="orders", retry={"maximumBackoff": "later"}))
    )
    created = create(api, ns, subscriber("billing", queue="orders", startPosition="2026-01-02T15:04:05Z",
                                         stallAfter="5m", retry={"minimumBackoff": "2s"}))
    assert created["spec"]["retry"] == {"minimumBackoff": "2s", "maximumBackoff": 600}
    assert "queue is immutable" in refused(lambda: patch_spec(api, ns, SUBSCRIBERS, "billing", queue="payments"))
    for plural, name in ((SUBSCRIBERS, "billing"), (QUEUES, "orders")):
        delete(api, ns, plural, name)  # no operator ran, so there are no finalizers


# --- the operator at work -----------------------------------------------------------------


def test_queue_is_created_changed_and_deleted(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    ref = QueueRef(ns, "orders")
    metrics_port = reserved_port()
    operators("--metrics-port", str(metrics_port))
    create(api, ns, queue("orders", shards=2, retention="1h", deletionPolicy="Delete"))

    ready = wait_ready(api, ns, QUEUES, "orders")
    assert ready["status"]["observedGeneration"] == ready["metadata"]["generation"] == 1
    # The reconcile is counted and timed on the metrics port (recorded before the status is written).
    applied = {"kind": "Queue", "action": "apply"}
    assert (scraped_value(metrics_port, "casque_operator_reconciles_total", **applied, outcome="ok") or 0) >= 1
    assert (scraped_value(metrics_port, "casque_operator_reconcile_duration_seconds_count", **applied) or 0) >= 1
    assert scraped_value(metrics_port, "casque_operator_leader") == 1.0
    assert ready_of(ready)["reason"] == "Reconciled"
    assert ready["status"]["shards"] == 2 and ready["status"]["lagBatches"] == 0
    assert FINALIZER in ready["metadata"]["finalizers"]
    assert table_ttl(backend, "orders", ns) == 3600
    assert heads(backend, ref) == ["0", "1"]
    assert catalog.read_queue(backend.store, ref).spec.retention_seconds == 3600
    assert ("Normal", "Applied") in [(t, r) for t, r, _ in events(kube_client, ns, "orders")]

    # A new retention changes the table's TTL; a new shard gets its head.
    patch_spec(api, ns, QUEUES, "orders", retention="2h", shards=3)
    changed = wait_ready(api, ns, QUEUES, "orders")
    assert changed["metadata"]["generation"] == changed["status"]["observedGeneration"] == 2
    assert table_ttl(backend, "orders", ns) == 7200
    assert heads(backend, ref) == ["0", "1", "2"]
    wait_for("the new shard in status", lambda: (get(api, ns, QUEUES, "orders") or {})["status"]["shards"] == 3)

    # Deletion with policy Delete drops the table and the znodes, then releases the finalizer.
    delete(api, ns, QUEUES, "orders")
    wait_for("the Queue to be gone", lambda: get(api, ns, QUEUES, "orders") is None)
    assert table_ttl(backend, "orders", ns) is None
    assert not backend.store.zk.exists(backend.store.paths(ref).base)


def test_retain_keeps_the_data_and_releases_the_finalizer(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    ref = QueueRef(ns, "audit")
    operators()
    create(api, ns, queue("audit", shards=3, retention="1d"))  # deletionPolicy defaults to Retain
    create(api, ns, subscriber("archiver", queue="audit", startPosition="earliest"))
    wait_ready(api, ns, QUEUES, "audit")
    wait_ready(api, ns, SUBSCRIBERS, "archiver")
    assert catalog.list_subscribers(backend.store, ref) == ["archiver"]

    delete(api, ns, QUEUES, "audit")
    wait_for("the Queue to be gone", lambda: get(api, ns, QUEUES, "audit") is None)
    assert table_ttl(backend, "audit", ns) == 86400
    assert catalog.read_queue(backend.store, ref).spec.shards == 3

    # A subscriber's state always goes with it.
    delete(api, ns, SUBSCRIBERS, "archiver")
    wait_for("the Subscriber to be gone", lambda: get(api, ns, SUBSCRIBERS, "archiver") is None)
    assert catalog.list_subscribers(backend.store, ref) == []

    # A Queue of the same name finds the retained data; fewer shards than it has is refused for good.
    create(api, ns, queue("audit", shards=2, retention="1d"))
    failed = wait_ready(api, ns, QUEUES, "audit", status="False", reason="InvalidChange")
    assert "shards can be added, never removed" in ready_of(failed)["message"]
    assert "observedGeneration" not in failed["status"]  # nothing of this spec was applied
    wait_for(
        "a Warning event for the refused change",
        lambda: ("Warning", "InvalidChange") in [(t, r) for t, r, _ in events(kube_client, ns, "audit")],
    )
    patch_spec(api, ns, QUEUES, "audit", shards=3)
    wait_ready(api, ns, QUEUES, "audit")


async def test_subscriber_status_follows_the_log(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    ref = QueueRef(ns, "orders")
    metrics_port = reserved_port()
    operators("--metrics-port", str(metrics_port))

    # A Subscriber applied before its Queue waits for it, and says so.
    create(api, ns, subscriber("billing", queue="orders", startPosition="earliest", deadLetterQueue="orders-dlq"))
    wait_ready(api, ns, SUBSCRIBERS, "billing", status="False", reason="QueueNotFound")
    wait_for(
        "a Warning event for the missing queue",
        lambda: ("Warning", "QueueNotFound") in [(t, r) for t, r, _ in events(kube_client, ns, "billing")],
    )
    create(api, ns, queue("orders", shards=2, retention="1h", consistency="ONE"))
    wait_ready(api, ns, SUBSCRIBERS, "billing", status="False", reason="DeadLetterQueueNotFound")
    create(api, ns, queue("orders-dlq", shards=1, retention="1h"))
    billing = wait_ready(api, ns, SUBSCRIBERS, "billing")
    assert billing["status"]["queue"] == "orders" and billing["status"]["lagBatches"] == 0

    # Messages published now show up as lag and depth at the next refresh.
    publisher = Publisher(backend.store, ref, catalog.read_queue(backend.store, ref))
    await publisher.publish([OutgoingMessage(f"m{i}".encode(), key=f"k{i}") for i in range(7)])
    await publisher.flush_heads()

    def lagging() -> dict[str, Any] | None:
        status = (get(api, ns, SUBSCRIBERS, "billing") or {}).get("status", {})
        return status if status.get("lagMessages") == 7 else None

    status = wait_for("the subscriber's lag", lagging)
    assert status["lagBatches"] >= 1 and status["oldestPendingTime"]
    orders = wait_for("the queue's depth", lambda: (get(api, ns, QUEUES, "orders") or {})["status"].get("depth") == 7)
    assert orders
    queue_status = (get(api, ns, QUEUES, "orders") or {})["status"]
    assert queue_status["publishedMessages"] == 7 and queue_status["subscribers"] == 1
    assert queue_status["oldestPendingTime"] == status["oldestPendingTime"]

    # The same figures on the operator's metrics port, for Prometheus and autoscalers.
    labels = f'namespace="{ns}",queue="orders",subscriber="billing"'
    lag_line = f"casque_subscriber_lag_messages{{{labels}}} 7.0"
    scraped = wait_for("the lag on the metrics port",
                       lambda: text if (text := _scrape(metrics_port)) and lag_line in text else None)
    assert f"casque_subscriber_lag_batches{{{labels}}} {float(status['lagBatches'])}" in scraped
    oldest = datetime.fromisoformat(status["oldestPendingTime"].replace("Z", "+00:00")).timestamp()
    oldest_series = f"casque_subscriber_oldest_pending_timestamp_seconds{{{labels}}}"
    (line,) = [x for x in scraped.splitlines() if x.startswith(oldest_series)]
    assert float(line.split()[-1]) == oldest


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return None


def scraped_value(port: int, name: str, **labels: str) -> float | None:
    """One sample of the operator's metrics port, None if it has no such series (or no answer)."""
    text = _scrape(port)
    for family in text_string_to_metric_families(text or ""):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def test_kubectl_get_shows_the_printer_columns(
    operators: Callable[..., Operator],
    kube_cluster: KubeCluster,  # noqa: F811
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    kubectl = kube_tool("kubectl")
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    operators()
    create(api, ns, queue("orders", shards=3, retention="1h"))
    create(api, ns, subscriber("billing", queue="orders"))
    wait_ready(api, ns, QUEUES, "orders")
    wait_ready(api, ns, SUBSCRIBERS, "billing")

    def table(*args: str) -> list[dict[str, str]]:
        """kubectl's table as one mapping per row, split at the header's column starts (cells may be empty)."""
        out = subprocess.run(
            [str(kubectl), "--kubeconfig", str(kube_cluster.kubeconfig_path), "get", *args, "-n", ns],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        header, *rows = out.splitlines()
        names = header.split()
        starts = [header.index(f"{name}") if i == 0 else header.index(f"  {name}") + 2 for i, name in enumerate(names)]
        bounds = list(zip(starts, [*starts[1:], None], strict=True))
        return [{name: row[a:b].strip() for name, (a, b) in zip(names, bounds, strict=True)} for row in rows]

    (orders,) = wait_for("kubectl to show the figures", lambda: (t := table("queues")) and t[0]["DEPTH"] and t)
    assert list(orders) == ["NAME", "SHARDS", "DEPTH", "LAG", "OLDEST", "READY", "AGE"]
    assert orders | {"AGE": ""} == {
        "NAME": "orders", "SHARDS": "3", "DEPTH": "0", "LAG": "0", "OLDEST": "", "READY": "True", "AGE": "",
    }  # fmt: skip
    (billing,) = wait_for("kubectl to show the subscriber", lambda: (t := table("csub")) and t[0]["BACKLOG"] and t)
    assert list(billing) == ["NAME", "QUEUE", "BACKLOG", "LAG", "OLDEST", "CONSUMERS", "READY", "AGE"]
    assert (billing["QUEUE"], billing["BACKLOG"], billing["LAG"], billing["READY"]) == ("orders", "0", "0", "True")
    (wide,) = table("cq", "-o", "wide")
    assert wide["REASON"] == "Reconciled"


def test_a_restart_changes_nothing_that_is_right(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    ref = QueueRef(ns, "orders")
    first = operators()
    create(api, ns, queue("orders", shards=2, retention="1h"))
    create(api, ns, subscriber("billing", queue="orders"))
    wait_ready(api, ns, QUEUES, "orders")
    wait_ready(api, ns, SUBSCRIBERS, "billing")

    def settled() -> bool:
        orders, billing = get(api, ns, QUEUES, "orders") or {}, get(api, ns, SUBSCRIBERS, "billing") or {}
        return orders["status"].get("subscribers") == 1 and billing["status"].get("lagMessages") == 0

    wait_for("the status to settle", settled)
    before = {plural: get(api, ns, plural, name) for plural, name in ((QUEUES, "orders"), (SUBSCRIBERS, "billing"))}
    _, znode = backend.store.zk.get(backend.store.paths(ref).base)
    assert first.stop() == 0

    second = operators()
    wait_for("the restarted operator to resume both objects", lambda: second.log().count("Resuming is processed") >= 2)
    wait_for("a status refresh", lambda: second.log().count("Timer 'refresh_queue' succeeded") >= 2)
    for (plural, name), obj in zip(((QUEUES, "orders"), (SUBSCRIBERS, "billing")), before.values(), strict=True):
        now = get(api, ns, plural, name)
        assert now is not None and obj is not None
        changed = {f"{part}.{key}": (obj[part].get(key), now[part].get(key))
                   for part in ("metadata", "status") for key in obj[part].keys() | now[part].keys()
                   if obj[part].get(key) != now[part].get(key)}
        assert not changed, f"{plural} changed by the restart (before, after): {changed}"
    assert backend.store.zk.get(backend.store.paths(ref).base)[1].mzxid == znode.mzxid


def test_drift_is_repaired_by_the_status_refresh(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    ref = QueueRef(ns, "orders")
    metrics_port = reserved_port()
    operators("--metrics-port", str(metrics_port))
    create(api, ns, queue("orders", shards=2, retention="1h"))
    wait_ready(api, ns, QUEUES, "orders")
    assert scraped_value(metrics_port, "casque_operator_drift_repairs_total", kind="Queue") is None

    backend.store.session.execute(drop_messages_table_ddl(backend.keyspace, ref))
    backend.store.zk.delete(backend.store.paths(ref).head(1))
    wait_for("the table to be re-created", lambda: table_ttl(backend, "orders", ns) == 3600)
    wait_for("the head to be re-created", lambda: heads(backend, ref) == ["0", "1"])
    repaired = wait_for(
        "a Repaired event",
        lambda: [m for t, r, m in events(kube_client, ns, "orders") if r == "Repaired"],
    )
    assert "the messages table is missing" in repaired[0]
    wait_ready(api, ns, QUEUES, "orders")
    # The table and the head, repaired by one refresh or by two: each refresh counts the drift
    # it saw, which its Repaired event names. A refresh that looked between the two changes
    # above saw the table alone and re-created the head as well, so count what they name.
    def counted_as_named() -> bool:
        named = sum(len(m.split("; ")) for _, r, m in events(kube_client, ns, "orders") if r == "Repaired")
        counted = scraped_value(metrics_port, "casque_operator_drift_repairs_total", kind="Queue") or 0
        return counted >= 1 and counted == named

    wait_for("the repairs counted as their events name them", counted_as_named)


def test_backend_outage_is_reported_and_retried(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    with refused_port() as port:  # held until the broken operator has stopped: nothing answers there
        nowhere = {**backend.env, "CASQUE_CASSANDRA_PORT": str(port)}
        metrics_port = reserved_port()
        broken = operators("--metrics-port", str(metrics_port), env=nowhere)
        create(api, ns, queue("orders", shards=1, retention="1h"))
        failed = wait_ready(api, ns, QUEUES, "orders", status="False", reason="BackendUnavailable")
        assert "Cassandra" in ready_of(failed)["message"]
        # Counted as an error by its reason, and as a reconcile that kopf retries.
        errors = scraped_value(metrics_port, "casque_operator_reconcile_errors_total", kind="Queue",
                               reason="BackendUnavailable")
        assert errors is not None and errors >= 1
        retried = scraped_value(metrics_port, "casque_operator_reconciles_total", kind="Queue", action="apply",
                                outcome="temporary_error")
        assert retried is not None and retried >= 1
        assert broken.stop() == 0

    operators()  # with the backends back, the resume applies the spec
    wait_ready(api, ns, QUEUES, "orders")
    assert table_ttl(backend, "orders", ns) == 3600


def test_one_leader_at_a_time_and_a_takeover(
    operators: Callable[..., Operator],
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    leases = client.CoordinationV1Api(kube_client)
    ns = kube_namespace
    first = operators("--identity", "first")
    wait_for("first to lead", lambda: "leading" in first.log())
    second = operators("--identity", "second")
    wait_for("second to campaign", lambda: "campaigning" in second.log())
    # The follower answers its liveness probe as a standby; the leader with the watch probe.
    standby = wait_for("the follower's liveness", second.liveness)
    assert standby == (200, {"role": "standby"})
    status, report = wait_for("the leader's liveness", first.liveness)
    assert status == 200 and set(report["watch"]) == {QUEUES, SUBSCRIBERS}

    create(api, ns, queue("orders", shards=1, retention="1h"))
    wait_ready(api, ns, QUEUES, "orders")
    assert "Handler 'apply_queue'" not in second.log()
    assert leases.read_namespaced_lease("casque-operator", ns).spec.holder_identity == "first"

    # The leader dies without releasing the Lease; the follower takes over once it expires.
    first.stop(signal.SIGKILL)
    wait_for("second to lead", lambda: "leading" in second.log(), timeout=30)
    assert leases.read_namespaced_lease("casque-operator", ns).spec.holder_identity == "second"
    create(api, ns, queue("payments", shards=1, retention="1h"))
    wait_ready(api, ns, QUEUES, "payments")

    # A leader that finds the Lease taken stops acting and exits, for its pod to restart. A
    # patch with no resourceVersion: a read and a replace would lose to a renewal between them.
    leases.patch_namespaced_lease("casque-operator", ns, {"spec": {"holderIdentity": "intruder"}})
    assert second.process.wait(timeout=30) == 3
    assert "leadership lost" in second.log()


def test_a_queue_over_the_namespaces_quota_is_refused_in_status_until_the_namespace_allows_it(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    """A refused Queue is applied again as soon as its Namespace's quota annotations change:
    its own retry is an hour away here, so only the Namespace's change can let it in."""
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    operators(env={**backend.env, **NO_QUOTA_RETRY, "CASQUE_QUOTA_MAX_QUEUES": "1",
                   "CASQUE_QUOTA_MAX_RETENTION": "1d"})
    create(api, ns, queue("first", shards=2, retention="1h"))
    wait_ready(api, ns, QUEUES, "first")
    create(api, ns, queue("second", retention="2d"))
    refusal = ready_of(wait_ready(api, ns, QUEUES, "second", status="False", reason="QuotaExceeded"))
    assert "1 queues and has 1 already" in refusal["message"]
    assert "retention 2d is longer than the namespace's limit of 1d" in refusal["message"]
    assert ("Warning", "QuotaExceeded") in [(t, r) for t, r, _ in events(kube_client, ns, "second")]
    assert not backend.store.zk.exists(backend.store.paths(QueueRef(ns, "second")).base)  # nothing created

    # A change of the Namespace that leaves its quotas as they were changes nothing.
    core = client.CoreV1Api(kube_client)
    core.patch_namespace(ns, {"metadata": {"labels": {"team": "billing"}}})
    # The platform team raises the namespace's limits with annotations on the Namespace.
    core.patch_namespace(ns, {"metadata": {"annotations": {
        "quota.casque.io/max-queues": "2", "quota.casque.io/max-retention": "7d"}}})
    wait_ready(api, ns, QUEUES, "second", reason="Reconciled")
    assert backend.store.zk.exists(backend.store.paths(QueueRef(ns, "second")).base)


def test_a_queue_refused_for_the_number_of_queues_is_made_once_another_is_deleted(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    """Deleting a Queue (and its data) makes room at once for one the namespace's quota
    refused, its own retry an hour away."""
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    operators(env={**backend.env, **NO_QUOTA_RETRY, "CASQUE_QUOTA_MAX_QUEUES": "1"})
    create(api, ns, queue("first", retention="1h", deletionPolicy="Delete"))
    wait_ready(api, ns, QUEUES, "first")
    create(api, ns, queue("second", retention="1h"))
    refusal = ready_of(wait_ready(api, ns, QUEUES, "second", status="False", reason="QuotaExceeded"))
    assert "1 queues and has 1 already" in refusal["message"]

    delete(api, ns, QUEUES, "first")
    wait_ready(api, ns, QUEUES, "second", reason="Reconciled")
    assert backend.store.zk.exists(backend.store.paths(QueueRef(ns, "second")).base)
    assert not backend.store.zk.exists(backend.store.paths(QueueRef(ns, "first")).base)


def test_a_queue_whose_znodes_do_not_fit_the_namespaces_znode_quota_is_refused_in_status(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    """The operator sets ZooKeeper's hard quota on the namespace's znode as it applies a
    Queue; a Queue whose znodes would take the namespace past it is refused with the quota's
    name, and made as soon as the Namespace allows more."""
    from casque.engine import znode_quotas
    from casque.znodes import queues_root

    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    operators(env={**backend.env, **NO_QUOTA_RETRY, "CASQUE_QUOTA_MAX_ZNODES": "100000",
                   "CASQUE_QUOTA_MAX_ZNODE_BYTES": "67108864"})
    create(api, ns, queue("first", shards=1, retention="1h"))
    wait_ready(api, ns, QUEUES, "first")
    own = f"{queues_root(backend.zk_root)}/{ns}"
    limits = f"{znode_quotas.quota_path('', own)}/{znode_quotas.LIMITS_NODE}"
    try:
        assert backend.store.zk.get(limits)[0] == znode_quotas.limits_data(
            znode_quotas.ZnodeQuota(max_znodes=100_000, max_bytes=64 << 20))
        assert ("Normal", "Applied") in [(t, r) for t, r, m in events(kube_client, ns, "first") if "quota" in m]

        # Room for two more znodes: a queue of eight shards needs more.
        def used(top: str) -> int:
            return 1 + sum(used(f"{top}/{child}") for child in backend.store.zk.get_children(top))
        client.CoreV1Api(kube_client).patch_namespace(ns, {"metadata": {"annotations": {
            "quota.casque.io/max-znodes": str(used(own) + 2)}}})
        create(api, ns, queue("second", shards=8, retention="1h"))
        refusal = ready_of(wait_ready(api, ns, QUEUES, "second", status="False", reason="QuotaExceeded"))
        assert "quota.casque.io/max-znodes" in refusal["message"], refusal

        client.CoreV1Api(kube_client).patch_namespace(ns, {"metadata": {"annotations": {
            "quota.casque.io/max-znodes": "1000"}}})
        wait_ready(api, ns, QUEUES, "second", reason="Reconciled")
        assert backend.store.zk.get(limits)[0] == znode_quotas.limits_data(
            znode_quotas.ZnodeQuota(max_znodes=1000, max_bytes=64 << 20))
    finally:
        backend.store.zk.delete(znode_quotas.quota_path("", own), recursive=True)


ZOOKEEPER_PASSWORD = "operator-test-installation-password-0123456789"
DERIVATION_KEY = "operator-test-derivation-key-0123456789"


@pytest.fixture
def secured_root(backend: Backend) -> Iterator[None]:
    """Set up before the operators, so removed after they stopped: the backend fixture's
    cleanup has no identity, and secured znodes go only with the installation's."""
    from kazoo.exceptions import NoNodeError

    yield
    admin = KazooClient(hosts=backend.env["CASQUE_ZOOKEEPER_HOSTS"],
                        auth_data=[("digest", f"casque:{ZOOKEEPER_PASSWORD}")])
    admin.start(timeout=15)
    try:
        # Its parent too: the operator created it, with the installation's ACL, as it
        # creates every missing ancestor of its root.
        admin.delete(backend.zk_root.rsplit("/", 1)[0], recursive=True)
    except NoNodeError:
        pass
    finally:
        admin.stop()
        admin.close()


def test_the_namespaces_zookeeper_identity_follows_its_queues(
    secured_root: None,
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    from kazoo.exceptions import NoAuthError
    from pydantic import SecretStr

    from casque.backends import zk as zk_backend
    from casque.config import Settings
    from casque.errors import AccessDenied

    api = client.CustomObjectsApi(kube_client)
    core = client.CoreV1Api(kube_client)
    ns = kube_namespace
    password = ZOOKEEPER_PASSWORD
    installation = Settings(zookeeper_hosts=backend.env["CASQUE_ZOOKEEPER_HOSTS"], zookeeper_root=backend.zk_root,
                            zookeeper_username="casque", zookeeper_password=SecretStr(password),
                            derivation_key=SecretStr(DERIVATION_KEY))
    env = {**backend.env, "CASQUE_ZOOKEEPER_USERNAME": "casque", "CASQUE_ZOOKEEPER_PASSWORD": password,
           "CASQUE_DERIVATION_KEY": DERIVATION_KEY}
    first = operators(env=env)
    create(api, ns, queue("orders", deletionPolicy="Delete"))
    create(api, ns, queue("audit", deletionPolicy="Delete"))
    wait_ready(api, ns, QUEUES, "orders")
    wait_ready(api, ns, QUEUES, "audit")
    secret = core.read_namespaced_secret("casque-zookeeper", ns)
    data = {key: base64.b64decode(value).decode() for key, value in secret.data.items()}
    assert data["username"] == f"casque.{ns}" and password not in str(data) and DERIVATION_KEY not in str(data)

    def sidecar_settings(data: dict[str, str]) -> Settings:
        return Settings(zookeeper_hosts=installation.zookeeper_hosts, zookeeper_root=backend.zk_root,
                        zookeeper_username=data["username"], zookeeper_password=SecretStr(data["password"]),
                        zookeeper_acl=data["acl"])

    def queues_seen_by(data: dict[str, str]) -> set[str]:
        """The namespace's queues, as a client logged in with the Secret's identity lists them."""
        own = zk_backend.connect(sidecar_settings(data), namespace=ns)
        try:
            return set(own.get_children(f"{backend.zk_root}/queues/{ns}"))
        finally:
            own.stop()
            own.close()

    # The Secret's identity works on its namespace; without it, nothing can be read.
    assert queues_seen_by(data) == {"orders", "audit"}
    with pytest.raises(NoAuthError):
        backend.store.zk.get(backend.store.paths(QueueRef(ns, "orders")).base)

    # A new derivation key: the restarted operator's reconciles re-secure the namespace's
    # znodes for its new identity and rewrite the Secret; the old identity is refused.
    first.stop()
    rotated_key = "operator-test-new-derivation-key-0123456789"
    operators(env={**env, "CASQUE_DERIVATION_KEY": rotated_key})

    def rewritten() -> dict[str, str] | None:
        current = core.read_namespaced_secret("casque-zookeeper", ns).data
        return current if current != secret.data else None

    rotated = {key: base64.b64decode(value).decode()
               for key, value in wait_for("the Secret to name the new key's identity", rewritten, timeout=300).items()}
    assert rotated["username"] == data["username"] and rotated["password"] != data["password"]
    assert queues_seen_by(rotated) == {"orders", "audit"}
    with pytest.raises(AccessDenied):
        zk_backend.connect(sidecar_settings(data), namespace=ns)
    secret = core.read_namespaced_secret("casque-zookeeper", ns)

    # One Queue deleted: the other still needs the identity. The last one: it goes.
    delete(api, ns, QUEUES, "orders")
    wait_for("orders to be gone", lambda: get(api, ns, QUEUES, "orders") is None)
    assert core.read_namespaced_secret("casque-zookeeper", ns).data == secret.data
    delete(api, ns, QUEUES, "audit")

    def secret_gone() -> bool:
        try:
            core.read_namespaced_secret("casque-zookeeper", ns)
        except ApiException as error:
            return error.status == 404
        return False

    wait_for("the namespace's Secret to be deleted with its last Queue", secret_gone)


def schema_condition(obj: dict[str, Any] | None) -> dict[str, Any]:
    return condition_of(obj, "SchemaCompatible")


def test_an_incompatible_schema_change_is_refused_and_a_compatible_one_accepted(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    ref = QueueRef(ns, "orders")
    operators()
    schema = {"type": "object", "properties": {"total": {"type": "number", "maximum": 1000}}}
    create(api, ns, queue("orders", shards=1, retention="1h", deletionPolicy="Delete", schema=schema))
    ready = wait_ready(api, ns, QUEUES, "orders")
    assert ready["status"]["schemaVersion"] == 1
    assert schema_condition(ready)["status"] == "True" and schema_condition(ready)["reason"] == "InForce"

    # Lowering a maximum may refuse what version 1 accepted: refused, version 1 stays in force.
    patch_spec(api, ns, QUEUES, "orders", schema={"properties": {"total": {"maximum": 500}}})
    refused_change = wait_ready(api, ns, QUEUES, "orders", status="False", reason="IncompatibleSchema")
    condition = schema_condition(refused_change)
    assert condition["status"] == "False" and condition["reason"] == "Incompatible"
    assert "/properties/total: maximum lowered from 1000 to 500" in condition["message"]
    assert "version 1, which stays in force" in condition["message"]
    assert refused_change["status"]["schemaVersion"] == 1
    state = catalog.read_queue(backend.store, ref)
    assert state.schema_version == 1 and state.spec.data_schema == schema

    # Raising it instead is compatible: version 2, in force.
    patch_spec(api, ns, QUEUES, "orders", schema={"properties": {"total": {"maximum": 5000}}})
    accepted = wait_ready(api, ns, QUEUES, "orders")
    assert accepted["status"]["schemaVersion"] == 2 and schema_condition(accepted)["status"] == "True"
    state = catalog.read_queue(backend.store, ref)
    assert state.schema_version == 2 and state.spec.data_schema is not None
    assert state.spec.data_schema["properties"]["total"]["maximum"] == 5000

    # A schema the operator cannot use (a keyword it would not check) is an invalid spec.
    patch_spec(api, ns, QUEUES, "orders", schema={"prefixItems": [{"type": "string"}]})
    invalid = wait_ready(api, ns, QUEUES, "orders", status="False", reason="InvalidSpec")
    assert "prefixItems" in ready_of(invalid)["message"]
    assert catalog.read_queue(backend.store, ref).schema_version == 2


def test_a_filter_that_does_not_compile_is_refused_with_the_checkers_words_and_a_good_one_applied(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    api = client.CustomObjectsApi(kube_client)
    ns = kube_namespace
    ref = QueueRef(ns, "orders")
    operators()
    create(api, ns, queue("orders", shards=1, retention="1h", deletionPolicy="Delete"))
    wait_ready(api, ns, QUEUES, "orders")
    create(api, ns, subscriber("eu-billing", queue="orders", filter='atributes.region == "eu"'))
    invalid = wait_ready(api, ns, SUBSCRIBERS, "eu-billing", status="False", reason="InvalidSpec")
    assert "undeclared reference to 'atributes.region'" in ready_of(invalid)["message"]
    assert "eu-billing" not in catalog.list_subscribers(backend.store, ref)  # nothing was written

    patch_spec(api, ns, SUBSCRIBERS, "eu-billing", filter='attributes.region == "eu" && "yes"')
    refused = wait_ready(api, ns, SUBSCRIBERS, "eu-billing", status="False", reason="InvalidSpec")
    assert "no matching overload for '_&&_'" in ready_of(refused)["message"]

    patch_spec(api, ns, SUBSCRIBERS, "eu-billing", filter='has(attributes.region) && attributes.region == "eu"')
    wait_ready(api, ns, SUBSCRIBERS, "eu-billing")
    # Its figures, read from the engine's statistics, count what the filter passed over: nothing yet.
    wait_for("the subscriber's filtered count",
             lambda: (get(api, ns, SUBSCRIBERS, "eu-billing") or {}).get("status", {}).get("filtered") == 0)
    stored = catalog.read_subscriber(backend.store, ref, "eu-billing")
    assert stored.spec.message_filter == 'has(attributes.region) && attributes.region == "eu"'


# --- the sidecar's Secrets, copied ----------------------------------------------------------


@pytest.fixture
def spare_namespaces(kube_client: client.ApiClient) -> Iterator[Callable[[], str]]:  # noqa: F811
    """More namespaces for one test, deleted afterwards (see kube_namespace)."""
    core = client.CoreV1Api(kube_client)
    made: list[str] = []

    def make() -> str:
        name = f"test-{uuid.uuid4().hex[:12]}"
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name,
                                                                              labels={"casque.io/test": "true"})))
        made.append(name)
        return name

    try:
        yield make
    finally:
        for name in made:
            try:
                core.delete_namespace(name)
            except ApiException as error:
                if error.status != 404:
                    raise


def read_secret(core: client.CoreV1Api, name: str, namespace: str) -> client.V1Secret | None:
    try:
        return core.read_namespaced_secret(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def secret(name: str, data: dict[str, str], **metadata: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": name, **metadata},
            "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}}


def test_the_sidecars_secret_is_copied_where_queues_are_follows_its_source_and_spares_the_users(
    operators: Callable[..., Operator],
    backend: Backend,
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
    spare_namespaces: Callable[[], str],
) -> None:
    from casque.operator.copies import SOURCE_ANNOTATION

    api = client.CustomObjectsApi(kube_client)
    core = client.CoreV1Api(kube_client)
    ns, home, other = kube_namespace, spare_namespaces(), spare_namespaces()
    name = "casque-cassandra"
    core.create_namespaced_secret(home, secret(name, {"username": "sidecars", "password": "first-password"}))
    # In the second served namespace, a Secret of the copy's name that the user made.
    users = core.create_namespaced_secret(other, secret(name, {"username": "mine", "password": "not-yours"}))
    operators("--namespace", other, env={**backend.env, "POD_NAMESPACE": home,
                                         "CASQUE_INJECTION_CREDENTIALS_SECRET": name})
    create(api, ns, queue("orders", deletionPolicy="Delete"))
    create(api, other, queue("audit", deletionPolicy="Delete"))
    try:
        wait_ready(api, ns, QUEUES, "orders")
        copy = wait_for(f"the copy of {name} in {ns}", lambda: read_secret(core, name, ns))
        source = core.read_namespaced_secret(name, home)
        assert copy.data == source.data and copy.type == "Opaque"
        assert copy.metadata.labels == {"app.kubernetes.io/managed-by": "casque-operator"}
        assert copy.metadata.annotations == {SOURCE_ANNOTATION: f"{home}/{name}"}

        # The user's Secret is left as it was, and the Queue says why its namespace has no copy.
        wait_ready(api, other, QUEUES, "audit")
        reported = wait_for("the unmanaged Secret to be reported on the Queue", lambda: [
            message for kind, reason, message in events(kube_client, other, "audit")
            if kind == "Warning" and reason == "SecretNotCopied"])
        assert name in reported[0] and "managed-by" in reported[0]
        assert core.read_namespaced_secret(name, other).metadata.resource_version == users.metadata.resource_version

        # A rotated source reaches the copy; the user's Secret is still not touched.
        core.patch_namespaced_secret(name, home, secret(name, {"username": "sidecars", "password": "rotated"}))
        rotated = core.read_namespaced_secret(name, home).data
        wait_for("the copy to follow its source", lambda: core.read_namespaced_secret(name, ns).data == rotated)
        assert core.read_namespaced_secret(name, other).metadata.resource_version == users.metadata.resource_version

        # The namespace's last Queue goes; the copy stays (pods may still read it: the
        # operator cannot list them).
        delete(api, ns, QUEUES, "orders")
        wait_for("orders to be gone", lambda: get(api, ns, QUEUES, "orders") is None)
        assert core.read_namespaced_secret(name, ns).data == rotated
        # ... and it is still the operator's to keep current: a second rotation reaches it.
        core.patch_namespaced_secret(name, home, secret(name, {"username": "sidecars", "password": "again"}))
        again = core.read_namespaced_secret(name, home).data
        wait_for("the copy without a Queue to follow its source", lambda: core.read_namespaced_secret(name, ns).data
                 == again)
    finally:
        delete(api, other, QUEUES, "audit")
        wait_for("audit to be gone", lambda: get(api, other, QUEUES, "audit") is None, timeout=300)


def test_the_webhooks_copy_makes_what_is_missing_and_nothing_else(
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
    spare_namespaces: Callable[[], str],
) -> None:
    from casque.operator.copies import WebhookCopier

    core = client.CoreV1Api(kube_client)
    home, users, stale = spare_namespaces(), spare_namespaces(), spare_namespaces()
    core.create_namespaced_secret(home, secret("creds", {"password": "installation"}))
    core.create_namespaced_secret(home, secret("ca", {"ca.crt": "certificate"}))
    core.create_namespaced_secret(users, secret("creds", {"password": "the user's"}))
    managed = {"app.kubernetes.io/managed-by": "casque-operator"}
    core.create_namespaced_secret(stale, secret("creds", {"password": "old"}, labels=managed))
    copier = WebhookCopier(lambda: kube_client, home, ["creds", "ca", "absent"], {})

    made = copier.copy(kube_namespace)
    assert sorted(made.written) == ["ca", "creds"] and made.missing == ["absent"]
    assert core.read_namespaced_secret("creds", kube_namespace).data == core.read_namespaced_secret("creds", home).data
    # A user's Secret is reported and kept; a stale copy is the leader's to correct, not the webhook's.
    kept = copier.copy(users)
    assert kept.written == ["ca"] and kept.unmanaged == ["creds"]
    assert base64.b64decode(core.read_namespaced_secret("creds", users).data["password"]) == b"the user's"
    assert copier.copy(stale).written == ["ca"]
    assert base64.b64decode(core.read_namespaced_secret("creds", stale).data["password"]) == b"old"
    # Again: everything is there, nothing is written.
    assert copier.copy(kube_namespace).written == []
