"""The chart and the example app on a real node: a kubelet with containerd on this machine
(tests/fixtures/node.py) and the images of the podman tests' build.

`helm install` with the backends in the release runs the operator from its image, and three
ZooKeeper members and Cassandra as StatefulSets; the examples' Queue and Subscriber become
Ready through it; the example worker's Deployment gets its sidecar from the operator's
webhook (called by the API server on the operator pod's address) and runs it as a native
sidecar; a second injected pod publishes orders through its own sidecar and completes, and
the worker receives and bills every one of them through its sidecar. (The chart pointed at
backends outside the cluster is installed, upgraded and rolled back by
tests/integration/test_node_upgrade.py.)

The release's NetworkPolicies are on (the default) and the node's firewall (kube-router's)
enforces them: the apps run in client namespaces, and a pod outside them, or without the
sidecar's label, is refused at the backends' client ports.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from cassandra import AuthenticationFailed, Unauthorized
from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import Cluster, NoHostAvailable
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import OPEN_ACL_UNSAFE, make_acl, make_digest_acl_credential

from casque.backends import cql, zk as zk_backend
from casque.backends.cql import SOCKET_OPTIONS
from casque.config import Settings
from casque.devstack.node import KubeNode
from casque.operator.resources import API_VERSION, QUEUE_KIND, SUBSCRIBER_KIND
from casque.schema import QueueRef
from casque.znodes import queue_paths
from tests.fixtures.doc_examples import yaml_blocks
from tests.fixtures.history import STALE, History, check, delivered_behind_acked_successors, keys_in_flight_twice
from tests.fixtures.node import NodeImages, pod_log
from tests.fixtures.node_apps import (
    HISTORY_APP,
    HISTORY_RESOURCES,
    POD_SECURITY,
    PROGRESS,
    RESTRICTED,
    HistoryTraffic,
    app_pod,
    is_ready,
)
from tests.fixtures.node_release import (
    ROOT,
    START_TIMEOUT,
    ZOOKEEPER_MEMBERS,
    EmbeddedRelease,
    Kubectl,
    client_namespace,
    history_of,
    records,
)
from tests.fixtures.waiting import wait_for

# Above the release fixture's own guard (helm install --wait: START_TIMEOUT * 2 + 60 s) plus
# a test's work: pytest-timeout's default of 600 s cut a slow install short on a loaded machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(START_TIMEOUT * 2 + 60 + 900)]

EXAMPLES = ROOT / "examples"
ORDERS = 20
HISTORY_RATE = 4
# The fault tests' publishers publish until the test stops them, once its last fault is over.
UNTIL_STOPPED = 1_000_000


def example_deployment(worker_image: str) -> dict[str, Any]:
    """examples/app-deployment.yaml with the image of this build, pulled from nowhere, and one
    replica (two cores)."""
    deployment: dict[str, Any] = yaml.safe_load((EXAMPLES / "app-deployment.yaml").read_text())
    deployment["spec"]["replicas"] = 1
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    container["image"] = worker_image
    container["imagePullPolicy"] = "Never"
    return deployment


PUBLISH = (
    "import sys\n"
    "from casque_client import Client\n"
    "with Client() as client:\n"
    "    for number in range(int(sys.argv[1])):\n"
    "        client.publish({'order': number})\n"
    "print('published', sys.argv[1], flush=True)\n"
)

def publisher_pod(worker_image: str) -> dict[str, Any]:
    """A pod that publishes ORDERS orders through its injected sidecar and exits; its
    sidecar, a native one, stops after it and the pod completes."""
    return app_pod("order-desk", worker_image, {"casque.io/queue": "orders", "casque.io/publish-scope": "orders"},
                   ["python3", "-c", PUBLISH, str(ORDERS)])


def run_the_example_app(kubectl: Kubectl, node: KubeNode, images: NodeImages, shop: str) -> None:
    """The examples' Queue, Subscriber and worker Deployment in `shop`, and a pod publishing
    ORDERS orders: the worker bills every one, each through its own injected sidecar."""
    kubectl("apply", "-n", shop, "-f", str(EXAMPLES / "queue.yaml"), "-f", str(EXAMPLES / "subscriber.yaml"))
    kubectl("wait", "-n", shop, "--for=condition=Ready", "queue/orders", "queue/orders-dlq",
            "subscriber/billing", f"--timeout={START_TIMEOUT}s")

    kubectl.apply(shop, example_deployment(images.worker))
    kubectl("rollout", "status", "-n", shop, "deployment/billing-worker", f"--timeout={START_TIMEOUT}s")
    (worker,) = kubectl.json("pods", "-n", shop, "-l", "app.kubernetes.io/name=billing-worker")["items"]
    # The webhook's output as the kubelet ran it: the sidecar first, a native sidecar.
    sidecar = worker["spec"]["initContainers"][0]
    assert (sidecar["name"], sidecar["image"], sidecar["restartPolicy"]) == (
        "casque-sidecar", images.sidecar, "Always")
    (app,) = worker["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in app["env"]}
    assert env["CASQUE_SIDECAR_URL"] == "http://127.0.0.1:8717"
    assert env["CASQUE_SIDECAR_SUBSCRIBERS"] == "billing"
    statuses = {s["name"]: s for s in worker["status"]["initContainerStatuses"]}
    assert statuses["casque-sidecar"]["ready"] is True

    kubectl.apply(shop, publisher_pod(images.worker))
    kubectl("wait", "-n", shop, "--for=jsonpath={.status.phase}=Succeeded", "pod/order-desk",
            f"--timeout={START_TIMEOUT}s")
    assert f"published {ORDERS}" in pod_log(node, shop, "order-desk", "app")

    name = worker["metadata"]["name"]

    def billed() -> set[int]:
        log = pod_log(node, shop, name, "worker")
        return {int(line.split()[2]) for line in log.splitlines() if line.startswith("billed order ")}

    wait_for(f"{ORDERS} orders billed", lambda: billed() == set(range(ORDERS)), timeout=START_TIMEOUT)


def remove_the_app(kubectl: Kubectl, shop: str) -> None:
    # The app first, while the operator still runs to remove the Queues' finalizers.
    kubectl("delete", "-n", shop, "deployments,pods", "--all", "--grace-period=1", f"--timeout={START_TIMEOUT}s",
            check=False)
    kubectl("delete", "-n", shop, "subscribers,queues", "--all", f"--timeout={START_TIMEOUT}s", check=False)
    kubectl("delete", "namespace", shop, "--wait=false", check=False)



def test_the_node_drops_no_loopback_traffic(kube_node: KubeNode) -> None:
    """Other test sessions' servers on 127.0.0.1 keep working while the node runs: nothing of
    the node's drops traffic to the loopback network (the kubelet's KUBE-FIREWALL would)."""
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert [r for r in rules if r.startswith("-A KUBE") and "127.0.0.0/8" in r and "DROP" in r] == []


def test_the_chart_with_its_own_zookeeper_and_cassandra_serves_the_example_app(
    embedded_release: EmbeddedRelease, node_images: NodeImages,
) -> None:
    kubectl, node = embedded_release.kubectl, embedded_release.node
    zookeepers = embedded_release.pods("zookeeper")
    assert [pod["metadata"]["name"] for pod in zookeepers] == [f"casque-zookeeper-{i}" for i in range(3)]
    # The members found each other by their stable names, through the node's cluster DNS: one
    # leads, the others follow.
    namespace = embedded_release.namespace
    modes = sorted(zookeeper_mode(kubectl, namespace, pod["metadata"]["name"]) or "" for pod in zookeepers)
    assert modes == ["follower", "follower", "leader"]
    # The operator was given the release's own Services, not addresses outside it.
    (operator,) = embedded_release.pods("casque")
    env = {item["name"]: item.get("value") for item in operator["spec"]["containers"][0]["env"]}
    namespace = embedded_release.namespace
    assert env["CASQUE_ZOOKEEPER_HOSTS"].startswith(f"casque-zookeeper.{namespace}.svc")
    shop = f"shop-{uuid.uuid4().hex[:8]}"
    client_namespace(kubectl, shop)
    try:
        run_the_example_app(kubectl, node, node_images, shop)
    except BaseException:
        kubectl.show(namespace, shop)
        raise
    finally:
        remove_the_app(kubectl, shop)


# Connects to each host:port of its arguments and prints one JSON line per target. `until-open`
# retries a target until it connects: the firewall admits a new pod once it has synced the pod's
# address into the policy's sets, shortly after the pod starts. `once` tries each target once:
# a firewall that refuses answers at once (kube-router rejects), an open port accepts.
PROBE = """\
import errno, json, socket, sys, time
mode, targets = sys.argv[1], sys.argv[2:]
for target in targets:
    host, port = target.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
            outcome = "connected"
        except OSError as e:
            outcome = errno.errorcode.get(e.errno, str(e)) if e.errno else type(e).__name__
        if outcome == "connected" or mode == "once":
            break
        time.sleep(0.5)
    print(json.dumps({"target": target, "outcome": outcome}), flush=True)
"""


def probe_pod(name: str, image: str, labels: dict[str, str], mode: str, targets: list[str]) -> dict[str, Any]:
    """A plain pod, no sidecar: it runs PROBE once against `targets`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": POD_SECURITY,
            "containers": [{"name": "app", "image": image, "imagePullPolicy": "Never",
                            "command": ["python3", "-c", PROBE, mode, *targets], "securityContext": RESTRICTED}],
        },
    }


def probed(kubectl: Kubectl, node: KubeNode, namespace: str, pod: dict[str, Any]) -> dict[str, str]:
    """Run a probe pod to its end; what each target answered."""
    kubectl.apply(namespace, pod)
    name = pod["metadata"]["name"]
    kubectl("wait", "-n", namespace, "--for=jsonpath={.status.phase}=Succeeded", f"pod/{name}",
            f"--timeout={START_TIMEOUT}s")
    return {entry["target"]: entry["outcome"] for entry in records(pod_log(node, namespace, name, "app"))}


def test_the_backends_client_ports_refuse_pods_outside_the_client_namespaces_or_without_the_sidecar_label(
    embedded_release: EmbeddedRelease, node_images: NodeImages,
) -> None:
    """The release's default NetworkPolicies, enforced by the node's firewall: a pod labelled
    as an injected one reaches Cassandra's and every ZooKeeper member's client port from a
    client namespace; the same pod in a namespace without the client label (a pod can set its
    own labels, not its namespace's), and a pod without the label in the client namespace,
    are refused. Without an enforcing firewall both would connect."""
    kubectl, node = embedded_release.kubectl, embedded_release.node
    targets = [f"{pod['status']['podIP']}:9042" for pod in embedded_release.pods("cassandra")]
    targets += [f"{pod['status']['podIP']}:2281" for pod in embedded_release.pods("zookeeper")]
    assert len(targets) == 1 + 3
    sidecar_label = {"casque.io/sidecar": "injected"}
    suffix = uuid.uuid4().hex[:8]
    clients, outside = f"clients-{suffix}", f"outside-{suffix}"
    client_namespace(kubectl, clients)
    kubectl.namespace(outside)
    try:
        # First a pod that is admitted, so that what the others meet is the policy, not a
        # network the node has yet to set up.
        admitted = probed(kubectl, node, clients, probe_pod("admitted", node_images.worker, sidecar_label,
                                                            "until-open", targets))
        assert admitted == dict.fromkeys(targets, "connected")
        other_namespace = probed(kubectl, node, outside, probe_pod("claims-the-label", node_images.worker,
                                                                   sidecar_label, "once", targets))
        unlabelled = probed(kubectl, node, clients, probe_pod("unlabelled", node_images.worker, {}, "once", targets))
        assert other_namespace == dict.fromkeys(targets, "ECONNREFUSED")
        assert unlabelled == dict.fromkeys(targets, "ECONNREFUSED")
    except BaseException:
        kubectl.show(clients, outside)
        raise
    finally:
        for namespace in (clients, outside):
            kubectl("delete", "-n", namespace, "pods", "--all", "--grace-period=1", f"--timeout={START_TIMEOUT}s",
                    check=False)
            kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# Asks the member's plain client port, which with TLS serves the pod's own loopback alone.
SRVR = "exec 3<>/dev/tcp/127.0.0.1/2181 && printf srvr >&3 && timeout 5 cat <&3"


def zookeeper_mode(kubectl: Kubectl, namespace: str, pod: str) -> str | None:
    """The `Mode:` of a ZooKeeper member's `srvr` answer (leader, follower, standalone), or
    None while it serves no clients."""
    answer = kubectl("exec", "-n", namespace, pod, "-c", "zookeeper", "--", "bash", "-c", SRVR, check=False)
    for line in answer.splitlines():
        if line.startswith("Mode: "):
            return line.removeprefix("Mode: ").strip()
    return None


def start_history_traffic(traffic: HistoryTraffic, worker_image: str) -> None:
    """The history queue and subscriber, a consumer pod and a paced publisher pod that publishes
    until stopped, returned once traffic moves."""
    kubectl, shop = traffic.kubectl, traffic.namespace
    kubectl("apply", "-n", shop, "-f", "-", stdin=HISTORY_RESOURCES)
    kubectl("wait", "-n", shop, "--for=condition=Ready", "queue/history", "subscriber/checker",
            f"--timeout={START_TIMEOUT}s")
    traffic.start_consumer("consumer", worker_image)
    traffic.start_publisher("publisher", worker_image, UNTIL_STOPPED, HISTORY_RATE)
    traffic.progress_after("the start")


def test_pods_failed_under_traffic_lose_no_acknowledged_publish(
    embedded_release: EmbeddedRelease, node_images: NodeImages,
) -> None:
    """Under a paced publisher and a consumer, each in its own injected pod: the consumer's
    sidecar killed with -9, the operator's pod deleted, the ZooKeeper leader's pod deleted, the
    Cassandra pod deleted, one after the other, each once the service is back from the one
    before. The pods' recorded calls then pass the history checker: every acknowledged publish
    delivered, nothing acked delivered again, every message acked."""
    kubectl, node, namespace = embedded_release.kubectl, embedded_release.node, embedded_release.namespace
    shop = f"shop-{uuid.uuid4().hex[:8]}"
    client_namespace(kubectl, shop)
    traffic = HistoryTraffic(kubectl, node, shop)

    def replaced(component: str, old_uid: str) -> bool:
        pods = embedded_release.pods(component)
        return bool(pods) and all(is_ready(p) and p["metadata"]["uid"] != old_uid for p in pods)

    try:
        start_history_traffic(traffic, node_images.worker)

        # The consumer's sidecar, killed with -9 by its runtime; the kubelet starts it again.
        (sidecar,) = [s for s in traffic.pod("consumer")["status"]["initContainerStatuses"]
                      if s["name"] == "casque-sidecar"]
        subprocess.run(node.ctr("tasks", "kill", "--signal", "SIGKILL", sidecar["containerID"].split("://")[1]),
                       check=True, capture_output=True)
        wait_for("the consumer's sidecar restarted and ready", lambda: any(
            s["name"] == "casque-sidecar" and s["restartCount"] >= 1 and s["ready"]
            for s in traffic.pod("consumer")["status"]["initContainerStatuses"]),
            timeout=START_TIMEOUT)
        traffic.progress_after("the sidecar's kill")

        (operator,) = embedded_release.pods("casque")
        kubectl("delete", "-n", namespace, "pod", operator["metadata"]["name"], "--wait=false")
        wait_for("a new operator pod ready", lambda: replaced("casque", operator["metadata"]["uid"]),
                 timeout=START_TIMEOUT)
        traffic.progress_after("the operator's pod was deleted")

        zookeepers = embedded_release.pods("zookeeper")
        (leader,) = [p for p in zookeepers if zookeeper_mode(kubectl, namespace, p["metadata"]["name"]) == "leader"]
        kubectl("delete", "-n", namespace, "pod", leader["metadata"]["name"], "--wait=false")

        def ensemble_back() -> bool:
            pods = embedded_release.pods("zookeeper")
            if leader["metadata"]["uid"] in {p["metadata"]["uid"] for p in pods} or not all(map(is_ready, pods)):
                return False
            modes = sorted(zookeeper_mode(kubectl, namespace, p["metadata"]["name"]) or "" for p in pods)
            return modes == ["follower", "follower", "leader"]
        wait_for("the ZooKeeper ensemble whole again", ensemble_back, timeout=START_TIMEOUT)
        traffic.progress_after("the ZooKeeper leader's pod was deleted")

        (cassandra,) = embedded_release.pods("cassandra")
        kubectl("delete", "-n", namespace, "pod", cassandra["metadata"]["name"], "--wait=false")
        wait_for("a new Cassandra pod ready", lambda: replaced("cassandra", cassandra["metadata"]["uid"]),
                 timeout=START_TIMEOUT)
        traffic.progress_after("the Cassandra pod was deleted")

        traffic.stop_publishers()
        traffic.checked_when_whole()
    except BaseException:
        kubectl.show(namespace, shop)
        raise
    finally:
        remove_the_app(kubectl, shop)


# The backends' pods: what a drain of a node for them moves.
BACKENDS = "app.kubernetes.io/name in (zookeeper,cassandra)"
# A drain evicts the three ZooKeeper members one at a time (their PodDisruptionBudget lets
# one be unready), each once the one before is Ready on the other node, then Cassandra.
DRAIN_TIMEOUT = START_TIMEOUT * 3


def backends_on(release: EmbeddedRelease, node: str) -> list[str]:
    """Each backend pod: its name, node, phase, readiness and restarts, as one line."""
    lines = []
    for pod in release.kubectl.json("pods", "-n", release.namespace, "-l", BACKENDS)["items"]:
        restarts = sum(s.get("restartCount", 0) for s in pod.get("status", {}).get("containerStatuses", []))
        lines.append(f"{pod['metadata']['name']} on {pod['spec'].get('nodeName', '-')}"
                     f"{'' if pod['spec'].get('nodeName') == node else ' (elsewhere)'}: "
                     f"{pod.get('status', {}).get('phase')}, {'ready' if is_ready(pod) else 'not ready'}, "
                     f"{restarts} restarts")
    return sorted(lines)


def drain(release: EmbeddedRelease, source: KubeNode, target: KubeNode) -> None:
    """Move the backends' pods from `source` to `target` with `kubectl drain`, and wait until
    all of them run Ready there."""
    kubectl = release.kubectl
    kubectl("uncordon", target.name)
    started = time.monotonic()
    result = subprocess.run([*kubectl.args, "drain", source.name, "--pod-selector", BACKENDS,
                             "--delete-emptydir-data", f"--timeout={DRAIN_TIMEOUT}s"],
                            capture_output=True, text=True, timeout=DRAIN_TIMEOUT + 60, check=False)
    if result.returncode != 0:
        print(*backends_on(release, target.name), sep="\n")
        pytest.fail(f"kubectl drain {source.name}: {result.stdout[-2000:]}{result.stderr[-2000:]}")

    def whole() -> bool:
        pods = kubectl.json("pods", "-n", release.namespace, "-l", BACKENDS)["items"]
        return len(pods) == ZOOKEEPER_MEMBERS + 1 and all(
            p["spec"].get("nodeName") == target.name and is_ready(p) for p in pods)
    try:
        wait_for(f"the backends Ready on {target.name}", whole, timeout=START_TIMEOUT)
    except pytest.fail.Exception:
        print(*backends_on(release, target.name), sep="\n")
        raise
    print(f"backends moved from {source.name} to {target.name} in {time.monotonic() - started:.0f}s")


def test_drained_nodes_move_the_backends_from_node_to_node_under_traffic_losing_nothing(
    embedded_release: EmbeddedRelease, node_images: NodeImages, second_node: KubeNode,
) -> None:
    """Under a paced publisher and a consumer on the first node, `kubectl drain` of the first
    node for the backends moves the three ZooKeeper members and Cassandra to the second node
    (their volumes are host paths both nodes mount), and a drain of the second moves them
    back; traffic goes on after each move, and the pods' recorded calls pass the history
    checker: every acknowledged publish delivered, nothing acked delivered again."""
    kubectl, first = embedded_release.kubectl, embedded_release.node
    shop = f"shop-{uuid.uuid4().hex[:8]}"
    client_namespace(kubectl, shop)
    traffic = HistoryTraffic(kubectl, first, shop)
    try:
        # The apps' images are on the first node only; the second stays cordoned until the drain.
        start_history_traffic(traffic, node_images.worker)
        drain(embedded_release, first, second_node)
        traffic.progress_after(f"the backends moved to {second_node.name}")
        drain(embedded_release, second_node, first)
        traffic.progress_after(f"the backends moved back to {first.name}")
        traffic.stop_publishers()
        traffic.checked_when_whole()
    except BaseException:
        kubectl.show(embedded_release.namespace, shop)
        raise
    finally:
        kubectl("uncordon", first.name, check=False)
        kubectl("cordon", second_node.name, check=False)
        remove_the_app(kubectl, shop)


TENANT_QUEUE = """\
apiVersion: casque.io/v1alpha1
kind: Queue
metadata: {name: ledger}
spec: {shards: 1, retention: 1d, deletionPolicy: Delete}
---
apiVersion: casque.io/v1alpha1
kind: Subscriber
metadata: {name: audit}
spec: {queue: ledger}
"""


def secret_values(kubectl: Kubectl, namespace: str, name: str) -> dict[str, str]:
    data = kubectl.json(f"secret/{name}", "-n", namespace)["data"]
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def cassandra_login(address: str, credentials: tuple[str, str] | None, tls: Settings | None) -> tuple[Cluster, Any]:
    auth = PlainTextAuthProvider(*credentials) if credentials else None
    cluster = Cluster([address], connect_timeout=10, auth_provider=auth, sockopts=SOCKET_OPTIONS,
                      **(cql.tls_options(tls) if tls else {}))
    try:
        return cluster, cluster.connect()
    except BaseException:
        cluster.shutdown()
        raise


def zookeeper_login(address: str, credentials: tuple[str, str] | None, tls: Settings) -> KazooClient:
    auth = [("digest", f"{credentials[0]}:{credentials[1]}")] if credentials else None
    zk = KazooClient(hosts=f"{address}:2281", auth_data=auth, **zk_backend.tls_options(tls))
    zk.start(timeout=30)
    return zk


def test_a_namespace_of_the_default_install_reaches_neither_another_namespaces_data_nor_the_default_superuser(
    embedded_release: EmbeddedRelease, tmp_path: Path,
) -> None:
    """The tenancy attack on a default install (isolation by default, issue 31): the backends'
    own addresses are reachable from every pod, so an attacker in namespace A holds A's
    Secrets and tries them, no login and Cassandra's well-known default login, on B. Both
    backends speak TLS only: the attacker has the CA, which every client namespace holds."""
    kubectl, namespace = embedded_release.kubectl, embedded_release.namespace
    (cassandra,) = embedded_release.pods("cassandra")
    cassandra_address = cassandra["status"]["podIP"]
    zookeeper_address = embedded_release.pods("zookeeper")[0]["status"]["podIP"]
    tls = embedded_release.client_tls(tmp_path)

    # In plain text neither backend answers: Cassandra's CQL port speaks TLS only, and
    # ZooKeeper's plain client port listens on its pod's loopback alone.
    with pytest.raises(NoHostAvailable):
        cassandra_login(cassandra_address, ("cassandra", "cassandra"), None)[0].shutdown()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((zookeeper_address, 2181), timeout=10).close()

    # Cassandra's default superuser and anonymous clients are refused.
    for credentials in (("cassandra", "cassandra"), None):
        with pytest.raises(NoHostAvailable) as refused:
            cassandra_login(cassandra_address, credentials, tls)[0].shutdown()
        assert all(isinstance(e, AuthenticationFailed) or "requires authentication" in str(e)
                   for e in refused.value.errors.values()), refused.value.errors

    suffix = uuid.uuid4().hex[:8]
    tenants = [f"tenant-a-{suffix}", f"tenant-b-{suffix}"]
    try:
        for tenant in tenants:
            kubectl("create", "namespace", tenant)
            kubectl("apply", "-n", tenant, "-f", "-", stdin=TENANT_QUEUE)
        for tenant in tenants:
            kubectl("wait", "-n", tenant, "--for=condition=Ready", "queue/ledger", "subscriber/audit",
                    f"--timeout={START_TIMEOUT}s")
        a, b = tenants
        a_role, b_role = (secret_values(kubectl, t, "casque-cassandra-role") for t in tenants)
        a_identity = secret_values(kubectl, a, "casque-zookeeper")
        assert a_role["keyspace"] != b_role["keyspace"]

        cluster, session = cassandra_login(cassandra_address, (a_role["username"], a_role["password"]), tls)
        try:
            def tables(keyspace: str) -> list[str]:
                rows = session.execute("SELECT table_name FROM system_schema.tables WHERE keyspace_name = %s",
                                       (keyspace,))
                return sorted(row.table_name for row in rows)

            # A's role reads its own keyspace, so the refusals below are for B's, not a bad login.
            for table in tables(a_role["keyspace"]):
                session.execute(f'SELECT * FROM "{a_role["keyspace"]}"."{table}" LIMIT 1')
            b_tables = tables(b_role["keyspace"])
            assert b_tables, f"no tables in {b_role['keyspace']}"
            for table in b_tables:
                with pytest.raises(Unauthorized):
                    session.execute(f'SELECT * FROM "{b_role["keyspace"]}"."{table}" LIMIT 1')
                with pytest.raises(Unauthorized):
                    session.execute(f'TRUNCATE "{b_role["keyspace"]}"."{table}"')
            with pytest.raises(Unauthorized):
                session.execute(f'GRANT SELECT ON KEYSPACE "{b_role["keyspace"]}" TO "{a_role["username"]}"')
        finally:
            cluster.shutdown()

        root = "/casque"
        a_paths, b_paths = (queue_paths(root, QueueRef(t, "ledger")) for t in tenants)
        zk = zookeeper_login(zookeeper_address, (a_identity["username"], a_identity["password"]), tls)
        try:
            zk.get(a_paths.base)
            zk.get_children(a_paths.base)
            for path in (b_paths.base, f"{root}/queues/{b}", b_paths.grant):
                with pytest.raises(NoAuthError):
                    zk.get(path)
            with pytest.raises(NoAuthError):
                zk.get_children(b_paths.base)
            with pytest.raises(NoAuthError):
                zk.set(b_paths.base, b"{}")
            with pytest.raises(NoAuthError):
                zk.create(f"{b_paths.base}/intruder", b"")
            # Where A's sidecars register, A may create: a znode naming only A, with a child.
            # The installation's login is the ensemble's superuser, so the operator still
            # removes it with the Subscriber below.
            only_a = [make_acl("digest", make_digest_acl_credential(a_identity["username"], a_identity["password"]),
                               all=True)]
            locked = a_paths.subscriber("audit").member("locked")
            zk.create(locked, b"", acl=only_a)
            zk.create(f"{locked}/child", b"", acl=only_a)
        finally:
            zk.stop()
            zk.close()
        anonymous = zookeeper_login(zookeeper_address, None, tls)
        try:
            for path in (a_paths.base, b_paths.base):
                with pytest.raises(NoAuthError):
                    anonymous.get(path)
        finally:
            anonymous.stop()
            anonymous.close()
        # The ensemble is the release's own: ZooKeeper's own znodes are closed to every login
        # but the installation's, A's and none alike (world:anyone:cdrwa out of the box).
        for login in ((a_identity["username"], a_identity["password"]), None):
            outsider = zookeeper_login(zookeeper_address, login, tls)
            try:
                for refused_call in (lambda: outsider.create("/intruder", b""),
                                     lambda: outsider.create("/zookeeper/quota/intruder", b""),
                                     lambda: outsider.set_acls("/", OPEN_ACL_UNSAFE)):
                    with pytest.raises(NoAuthError):
                        refused_call()
            finally:
                outsider.stop()
                outsider.close()
        kubectl("delete", "-n", a, "subscriber/audit", "queue/ledger", f"--timeout={START_TIMEOUT}s")
        installation = secret_values(kubectl, namespace, "casque-zookeeper")
        admin = zookeeper_login(zookeeper_address, (installation["username"], installation["password"]), tls)
        try:
            assert admin.exists(a_paths.subscriber("audit").base) is None  # where the locked znode was
            assert admin.exists(a_paths.base) is None and admin.exists(b_paths.base) is not None
        finally:
            admin.stop()
            admin.close()
    except BaseException:
        kubectl.show(namespace, *tenants)
        raise
    finally:
        for tenant in tenants:
            kubectl("delete", "-n", tenant, "queues", "--all", f"--timeout={START_TIMEOUT}s", check=False)
            kubectl("delete", "namespace", tenant, "--wait=false", check=False)


# A shared, ordered subscriber: its consumers may outnumber the queue's shards.
AUTOSCALED: list[dict[str, Any]] = [
    {"apiVersion": API_VERSION, "kind": QUEUE_KIND, "metadata": {"name": "jobs"},
     "spec": {"shards": 2, "retention": "1d"}},
    {"apiVersion": API_VERSION, "kind": SUBSCRIBER_KIND, "metadata": {"name": "workers"},
     "spec": {"queue": "jobs", "startPosition": "earliest", "delivery": "shared", "orderedKeys": True,
              "visibilityTimeout": "30s"}},
]
AUTOSCALED_MESSAGES = 360
AUTOSCALED_KEYS = 12
# Seconds each consumer spends on a message: one consumer alone takes minutes over the backlog.
HANDLE_SECONDS = 0.2


def documented_autoscaler(namespace: str, deployment: str, subscriber: str) -> dict[str, Any]:
    """The HorizontalPodAutoscaler of docs/deploy.md, for this Deployment and Subscriber, scaling
    down after 15 s without a backlog rather than 120 s."""
    (hpa,) = [d for block in yaml_blocks(ROOT / "docs" / "deploy.md") for d in yaml.safe_load_all(block)
              if d and d.get("kind") == "HorizontalPodAutoscaler"]
    hpa["metadata"] = {"name": subscriber, "namespace": namespace}
    hpa["spec"]["scaleTargetRef"]["name"] = deployment
    hpa["spec"]["maxReplicas"] = 3
    (metric,) = hpa["spec"]["metrics"]
    metric["external"]["metric"]["selector"]["matchLabels"] = {"subscriber": subscriber}
    metric["external"]["target"]["averageValue"] = "40"
    hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] = 15
    return hpa


def consumer_deployment(name: str, image: str, records: Path, replicas: int = 1, node: str | None = None,
                        handle_seconds: float = HANDLE_SECONDS) -> dict[str, Any]:
    """Consumers of `workers`, each writing its calls to `records` on the host as well, where
    they outlive the pods the autoscaler or a rolling update removes; with `node`, on that
    node only."""
    labels = {"app": name}
    placement = {"nodeSelector": {"kubernetes.io/hostname": node}} if node else {}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "casque.io/inject": "true", "casque.io/queue": "jobs", "casque.io/subscriber": "workers"}},
                "spec": {
                    **placement,
                    "securityContext": POD_SECURITY, "terminationGracePeriodSeconds": 30,
                    "volumes": [{"name": "records", "hostPath": {"path": str(records), "type": "Directory"}}],
                    "containers": [{
                        "name": "app", "image": image, "imagePullPolicy": "Never",
                        "command": ["python3", "-c", HISTORY_APP.read_text(), "consume", str(handle_seconds)],
                        "env": [{"name": "CASQUE_HISTORY_RECORDS", "value": "/records"}],
                        "volumeMounts": [{"name": "records", "mountPath": "/records"}],
                        "securityContext": RESTRICTED,
                    }],
                },
            },
        },
    }  # fmt: skip


def workers_namespace(kubectl: Kubectl, tmp_path: Path) -> tuple[str, Path]:
    """A client namespace for `workers`' consumers, and the host directory they record their calls in."""
    shop = f"shop-{uuid.uuid4().hex[:8]}"
    client_namespace(kubectl, shop)
    records = tmp_path / "records"
    records.mkdir()
    records.chmod(0o777)  # the consumers run as POD_SECURITY's user
    return shop, records


def apply_autoscaled(kubectl: Kubectl, shop: str) -> None:
    """The queue `jobs` and its shared, ordered subscriber `workers`, once both are Ready."""
    for resource in AUTOSCALED:
        kubectl.apply(shop, resource)
    kubectl("wait", "-n", shop, "--for=condition=Ready", "queue/jobs", "subscriber/workers",
            f"--timeout={START_TIMEOUT}s")


def recorded(records: Path) -> dict[str, list[dict[str, Any]]]:
    """Each consumer pod's calls, by pod name."""
    return {path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in sorted(records.glob("*.jsonl"))}


def every_message_acked(kubectl: Kubectl, node: KubeNode, shop: str, records: Path, messages: int) -> None:
    """Wait until the consumers recorded in `records` acked m0..m<messages - 1> and the
    subscriber `workers` has no lag; if they do not, fail naming the keys that stopped."""
    unsettled: list[str] = []

    def drained() -> bool:
        # Acked, or acked with an answer that says the ack may have counted (a 503 whose
        # row was written before its ZooKeeper check failed: the message may not come
        # again), as the history checker counts them; the lag below shows none is left.
        settled = {e["id"] for calls in recorded(records).values() for e in calls
                   if e["op"] == "ack" and e["outcome"] != STALE}
        unsettled[:] = sorted({f"m{i}" for i in range(messages)} - settled, key=lambda m: int(m[1:]))
        return not unsettled
    try:
        wait_for("every message acked", drained, timeout=START_TIMEOUT * 2)
        kubectl("wait", "-n", shop, "--for=jsonpath={.status.lagMessages}=0", "subscriber/workers",
                f"--timeout={START_TIMEOUT}s")
    except (pytest.fail.Exception, AssertionError):
        # Which keys stopped moving says more than the count: message i has key i % keys.
        keys = sorted({int(m[1:]) % AUTOSCALED_KEYS for m in unsettled})
        for pod in sorted(p["metadata"]["name"] for p in kubectl.json("pods", "-n", shop, "-l", "app=consumers")["items"]):
            tail = pod_log(node, shop, pod, "casque-sidecar").splitlines()[-80:]  # what it said of its ranges
            print(f"--- {pod}/casque-sidecar, last {len(tail)} lines", *tail, sep="\n")
        pytest.fail(f"{len(unsettled)} of {messages} never acked, of keys {keys}: {unsettled[:12]}; "
                    "or the subscriber's lag did not reach 0")


def checked_keyed_history(publisher: list[dict[str, Any]], calls: dict[str, list[dict[str, Any]]],
                          messages: int) -> History:
    """The history of a keyed run (message n has key n % AUTOSCALED_KEYS), asserted: every
    acknowledged publish delivered and nothing acked delivered again; no key's message handed
    out behind an acked later one of its key, nor two of a key at once; each key's messages
    first handed out in the order they were published."""
    history = history_of(publisher, list(calls.values()))
    verdict = check(history)
    assert verdict.ok, str(verdict)
    assert len(history.published) == messages
    keys = {f"m{n}": (f"k{n % AUTOSCALED_KEYS}", n) for n in range(messages)}
    assert delivered_behind_acked_successors(history, keys) == []
    assert keys_in_flight_twice(history, {m: key for m, (key, _) in keys.items()}, visibility=30.0) == []
    first: dict[str, float] = {}
    for delivery in history.deliveries:
        first[delivery.message_id] = min(first.get(delivery.message_id, delivery.answered), delivery.answered)
    for key in {key for key, _ in keys.values()}:
        ordered = sorted((n for m, (k, n) in keys.items() if k == key), key=lambda n: first[f"m{n}"])
        assert ordered == sorted(ordered), f"key {key} handed out as {ordered}"
    return history


def test_an_autoscaler_grows_the_consumers_with_the_backlog_and_shrinks_them_losing_and_reordering_nothing(
    embedded_release: EmbeddedRelease, node_images: NodeImages, tmp_path: Path,
) -> None:
    """The HorizontalPodAutoscaler of docs/deploy.md, run by the node's kube-controller-manager
    on the lag the operator serves through the External Metrics API: a keyed backlog on a
    shared, ordered subscriber grows its consumer Deployment from 1 to 3, the backlog drains,
    and it shrinks back to 1, the leaving consumers acking what they hold. Over the whole run
    the history checker finds every acknowledged publish delivered and nothing acked delivered
    again; no key's message was handed out behind a later one of its key, nor two of a key at
    once; and the subscriber counts exactly the consumer left."""
    kubectl, node = embedded_release.kubectl, embedded_release.node
    shop, records = workers_namespace(kubectl, tmp_path)
    traffic = HistoryTraffic(kubectl, node, shop)

    def autoscaler() -> dict[str, Any]:
        found: dict[str, Any] = kubectl.json("hpa/workers", "-n", shop)
        return found

    def replicas() -> tuple[int, int]:
        publisher = traffic.pod("publisher")["status"].get("phase")
        assert publisher != "Failed", f"the publisher failed: {traffic.calls('publisher')[-3:]}"
        status = kubectl.json("deployment/consumers", "-n", shop)["status"]
        return status.get("replicas", 0), status.get("readyReplicas", 0)

    try:
        apply_autoscaled(kubectl, shop)
        kubectl.apply(shop, consumer_deployment("consumers", node_images.worker, records))
        kubectl("wait", "-n", shop, "--for=condition=Available", "deployment/consumers", f"--timeout={START_TIMEOUT}s")
        kubectl.apply(shop, documented_autoscaler(shop, "consumers", "workers"))

        traffic.start_publisher("publisher", node_images.worker, AUTOSCALED_MESSAGES, 60, keys=AUTOSCALED_KEYS,
                                queue="jobs")
        wait_for("the autoscaler at 3 consumers, all ready", lambda: replicas() == (3, 3), timeout=START_TIMEOUT)
        # What it scaled on: the lag per consumer, read through the aggregation layer.
        (current,) = autoscaler()["status"]["currentMetrics"]
        assert current["external"]["metric"]["name"] == "casque-subscriber-lag-messages", current

        def consumer_pods() -> set[str]:
            listing = kubectl.json("pods", "-n", shop, "-l", "app=consumers")["items"]
            return {p["metadata"]["name"] for p in listing}

        every_message_acked(kubectl, node, shop, records, AUTOSCALED_MESSAGES)
        # The Deployment at 1, and the pods it removed gone (their apps stopped, their sidecars after).
        wait_for("the autoscaler back at 1 consumer", lambda: replicas() == (1, 1) and len(consumer_pods()) == 1,
                 timeout=START_TIMEOUT)
        kubectl("wait", "-n", shop, "--for=jsonpath={.status.phase}=Succeeded", "pod/publisher",
                f"--timeout={START_TIMEOUT}s")

        calls = recorded(records)
        live = consumer_pods()
        # The three consumers the autoscaler ran (awaited above): a pod that came once the
        # backlog was gone, and is the one left, may have received nothing, so record nothing.
        assert len(set(calls) | live) >= 3 and len(live) == 1, (sorted(calls), live)
        # Every consumer the autoscaler removed left as asked: its acks answered, then stopped.
        for pod, entries in calls.items():
            if pod not in live:
                assert entries[-1]["op"] == "stopped", f"{pod} did not stop as asked: {entries[-3:]}"
        history = checked_keyed_history(traffic.calls("publisher"), calls, AUTOSCALED_MESSAGES)
        # The one consumer left is the one member of the group.
        wait_for("the subscriber counting one consumer", lambda: kubectl.json(
            "subscriber/workers", "-n", shop).get("status", {}).get("consumers") == 1, timeout=START_TIMEOUT)
        print(f"autoscaled history: {len(history.published)} published, {len(history.deliveries)} deliveries "
              f"({history.redeliveries()} again) over {len(calls)} consumer pods")
    except BaseException:
        kubectl.show(embedded_release.namespace, shop)
        raise
    finally:
        remove_the_app(kubectl, shop)


# A rolling update's traffic: 600 keyed messages at 8 a second, so that they flow for the
# whole update (two pods replaced, each Ready in 20 to 40 s).
ROLLED_MESSAGES = 600
ROLLED_RATE = 8
ROLLED_HANDLE_SECONDS = 0.05


def test_a_rolling_update_moves_the_consumers_to_the_other_node_under_traffic_losing_and_reordering_nothing(
    embedded_release: EmbeddedRelease, node_images: NodeImages, second_node: KubeNode, tmp_path: Path,
) -> None:
    """A shared, ordered subscriber's consumer Deployment of two pods on the first node, under a
    paced keyed publisher. A rolling update whose template places the pods on the second node
    replaces them one at a time (the new pod Ready before an old one is stopped). Every pod
    that left acked what it held and stopped; over the whole run the history checker finds
    every acknowledged publish delivered and nothing acked delivered again, and no key's
    message went out behind a later one of its key, nor two of a key at once."""
    kubectl, first = embedded_release.kubectl, embedded_release.node
    for image in (node_images.sidecar, node_images.worker):
        second_node.import_image(image)
    shop, records = workers_namespace(kubectl, tmp_path)
    traffic = HistoryTraffic(kubectl, first, shop)

    def consumers() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = kubectl.json("pods", "-n", shop, "-l", "app=consumers")["items"]
        return found

    def acks() -> int:
        return sum(1 for calls in recorded(records).values() for e in calls if e["op"] == "ack")

    try:
        apply_autoscaled(kubectl, shop)
        kubectl.apply(shop, consumer_deployment("consumers", node_images.worker, records, replicas=2,
                                                node=first.name, handle_seconds=ROLLED_HANDLE_SECONDS))
        kubectl("wait", "-n", shop, "--for=condition=Available", "deployment/consumers", f"--timeout={START_TIMEOUT}s")
        traffic.start_publisher("publisher", node_images.worker, ROLLED_MESSAGES, ROLLED_RATE, keys=AUTOSCALED_KEYS,
                                queue="jobs")
        wait_for("traffic to flow", lambda: acks() >= PROGRESS, timeout=START_TIMEOUT)
        before = {p["metadata"]["name"] for p in consumers()}
        assert traffic.pod("publisher")["status"].get("phase") == "Running", "the traffic ended before the update"

        kubectl("uncordon", second_node.name)
        kubectl.apply(shop, consumer_deployment("consumers", node_images.worker, records, replicas=2,
                                                node=second_node.name, handle_seconds=ROLLED_HANDLE_SECONDS))
        kubectl("rollout", "status", "-n", shop, "deployment/consumers", f"--timeout={START_TIMEOUT * 2}s",
                timeout=START_TIMEOUT * 2)
        wait_for(f"the old consumers gone, two Ready on {second_node.name}", lambda: (pods := consumers()) and len(
            pods) == 2 and all(p["spec"].get("nodeName") == second_node.name and is_ready(p) for p in pods),
            timeout=START_TIMEOUT)
        during = acks()
        every_message_acked(kubectl, first, shop, records, ROLLED_MESSAGES)
        kubectl("wait", "-n", shop, "--for=jsonpath={.status.phase}=Succeeded", "pod/publisher",
                f"--timeout={START_TIMEOUT}s")

        calls = recorded(records)
        for pod in before:  # each replaced pod left as asked: its acks answered, then stopped
            left = calls.get(pod, [])
            assert left and left[-1]["op"] == "stopped", f"{pod} did not stop as asked: {left[-3:]}"
        assert set(calls) - before, "no consumer on the second node received anything"
        history = checked_keyed_history(traffic.calls("publisher"), calls, ROLLED_MESSAGES)
        print(f"rolled history: {len(history.published)} published, {len(history.deliveries)} deliveries "
              f"({history.redeliveries()} again), {during} acks before the update ended, over {len(calls)} pods")
    except BaseException:
        kubectl.show(embedded_release.namespace, shop)
        raise
    finally:
        remove_the_app(kubectl, shop)
        kubectl("cordon", second_node.name, check=False)
