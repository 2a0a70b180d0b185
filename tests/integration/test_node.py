"""The chart and the example app on a real node: a kubelet with containerd on this machine
(tests/fixtures/node.py), the images of the podman tests' build, Cassandra and ZooKeeper on
the host's address.

`helm install` runs the operator from its image; the examples' Queue and Subscriber become
Ready through it; the example worker's Deployment gets its sidecar from the operator's
webhook (called by the API server on the operator pod's address) and runs it as a native
sidecar; a second injected pod publishes orders through its own sidecar and completes, and
the worker receives and bills every one of them through its sidecar.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cassandra.cluster import Cluster
from kazoo.client import KazooClient

from casque.backends.cql import SOCKET_OPTIONS
from casque.devstack.kube import KubeCluster, kube_binary
from casque.devstack.node import KubeNode
from casque.devstack.stack import Stack
from tests.fixtures.node import NodeImages, pod_log
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "casque"
EXAMPLES = ROOT / "examples"
ORDERS = 20
# Generous: the first start of each image on a busy two-core machine; the conditions below are
# awaited, never slept for.
START_TIMEOUT = 300


def run(*argv: str | Path, timeout: float = START_TIMEOUT + 60) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def repository_and_tag(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    return repository, tag


def helm_values(images: NodeImages, stack: Stack, keyspace: str, zk_root: str) -> list[str]:
    operator_repository, operator_tag = repository_and_tag(images.operator)
    sidecar_repository, sidecar_tag = repository_and_tag(images.sidecar)
    values = {
        "image.pullPolicy": "Never",
        "operator.image.repository": operator_repository,
        "operator.image.tag": operator_tag,
        "sidecar.image.repository": sidecar_repository,
        "sidecar.image.tag": sidecar_tag,
        "operator.replicas": "1",
        "cassandra.contactPoints": "{" + ",".join(stack.contact_points) + "}",
        "cassandra.port": str(stack.ports.native),
        "cassandra.keyspace": keyspace,
        "cassandra.replication.strategy": "SimpleStrategy",
        "cassandra.replication.factor": "1",
        "zookeeper.connect": stack.zookeeper_hosts,
        "zookeeper.root": zk_root,
        # A pod the webhook did not answer for fails to be created instead of running without
        # its sidecar.
        "injection.failurePolicy": "Fail",
    }
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


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
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "order-desk", "annotations": {
            "casque.io/inject": "true", "casque.io/queue": "orders", "casque.io/publish-scope": "orders"}},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10002, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "desk",
                "image": worker_image,
                "imagePullPolicy": "Never",
                "command": ["python3", "-c", PUBLISH, str(ORDERS)],
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }


class Kubectl:
    def __init__(self, cluster: KubeCluster) -> None:
        self.args = cluster.kubectl_args()

    def __call__(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        result = subprocess.run([*self.args, *args], input=stdin, capture_output=True, text=True,
                                timeout=START_TIMEOUT + 60, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def apply(self, namespace: str, manifest: dict[str, Any]) -> None:
        self("apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest))

    def json(self, *args: str) -> Any:
        return json.loads(self("get", "-o", "json", *args))


@pytest.fixture
def keyspace_and_root(node_stack: Stack) -> Iterator[tuple[str, str]]:
    """A keyspace and a ZooKeeper root of the test's own on the node's stack, removed after."""
    suffix = uuid.uuid4().hex[:12]
    keyspace, zk_root = f"node_{suffix}", f"/node-{suffix}"
    try:
        yield keyspace, zk_root
    finally:
        cluster = node_stack.zookeeper().members()[0]
        zk = KazooClient(hosts=cluster.connect_string)
        zk.start(timeout=15)
        zk.delete(zk_root, recursive=True)
        zk.stop()
        zk.close()
        cql = Cluster(node_stack.contact_points, port=node_stack.ports.native, sockopts=SOCKET_OPTIONS)
        try:
            cql.connect().execute(f"DROP KEYSPACE IF EXISTS {keyspace}", timeout=60)
        finally:
            cql.shutdown()


def test_the_chart_runs_the_operator_and_the_example_app_publishes_and_receives_through_its_sidecars(
    kube_node: KubeNode,
    node_cluster: KubeCluster,
    node_images: NodeImages,
    node_stack: Stack,
    keyspace_and_root: tuple[str, str],
) -> None:
    kubectl = Kubectl(node_cluster)
    helm = kube_binary("helm")
    suffix = uuid.uuid4().hex[:8]
    system, shop = f"casque-{suffix}", f"shop-{suffix}"
    keyspace, zk_root = keyspace_and_root
    kubeconfig = ["--kubeconfig", str(node_cluster.kubeconfig_path)]
    # Other test sessions' servers on 127.0.0.1 must keep working while the node runs: nothing
    # of the node's drops traffic to the loopback network (the kubelet's KUBE-FIREWALL would).
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert [r for r in rules if r.startswith("-A KUBE") and "127.0.0.0/8" in r and "DROP" in r] == []
    try:
        # --wait: the operator's Deployment Available, i.e. its pod Ready on the node (its image,
        # its service-account token, the API server through the kubernetes Service).
        run(helm, "install", "casque", CHART, "--namespace", system, "--create-namespace", *kubeconfig,
            *helm_values(node_images, node_stack, keyspace, zk_root), "--wait", "--timeout", f"{START_TIMEOUT}s")

        kubectl("create", "namespace", shop)
        kubectl("apply", "-n", shop, "-f", str(EXAMPLES / "queue.yaml"), "-f", str(EXAMPLES / "subscriber.yaml"))
        kubectl("wait", "-n", shop, "--for=condition=Ready", "queue/orders", "queue/orders-dlq",
                "subscriber/billing", f"--timeout={START_TIMEOUT}s")

        kubectl.apply(shop, example_deployment(node_images.worker))
        kubectl("rollout", "status", "-n", shop, "deployment/billing-worker", f"--timeout={START_TIMEOUT}s")
        (worker,) = kubectl.json("pods", "-n", shop, "-l", "app.kubernetes.io/name=billing-worker")["items"]
        # The webhook's output as the kubelet ran it: the sidecar first, a native sidecar.
        sidecar = worker["spec"]["initContainers"][0]
        assert (sidecar["name"], sidecar["image"], sidecar["restartPolicy"]) == (
            "casque-sidecar", node_images.sidecar, "Always")
        (app,) = worker["spec"]["containers"]
        env = {item["name"]: item.get("value") for item in app["env"]}
        assert env["CASQUE_SIDECAR_URL"] == "http://127.0.0.1:8717"
        assert env["CASQUE_SIDECAR_SUBSCRIBERS"] == "billing"
        statuses = {s["name"]: s for s in worker["status"]["initContainerStatuses"]}
        assert statuses["casque-sidecar"]["ready"] is True

        kubectl.apply(shop, publisher_pod(node_images.worker))
        kubectl("wait", "-n", shop, "--for=jsonpath={.status.phase}=Succeeded", "pod/order-desk",
                f"--timeout={START_TIMEOUT}s")
        assert f"published {ORDERS}" in pod_log(kube_node, shop, "order-desk", "desk")

        name = worker["metadata"]["name"]

        def billed() -> set[int]:
            log = pod_log(kube_node, shop, name, "worker")
            return {int(line.split()[2]) for line in log.splitlines() if line.startswith("billed order ")}

        wait_for(f"{ORDERS} orders billed", lambda: billed() == set(range(ORDERS)), timeout=START_TIMEOUT)
    except BaseException:
        for namespace in (system, shop):
            print(kubectl("get", "pods,events", "-n", namespace, "-o", "wide", check=False))
        raise
    finally:
        # The app first, while the operator still runs to remove the Queues' finalizers.
        kubectl("delete", "-n", shop, "deployment/billing-worker", "pod/order-desk", "--ignore-not-found",
                "--grace-period=1", f"--timeout={START_TIMEOUT}s", check=False)
        kubectl("delete", "-n", shop, "subscribers,queues", "--all", f"--timeout={START_TIMEOUT}s", check=False)
        subprocess.run([str(helm), "uninstall", "casque", "--namespace", system, *kubeconfig, "--wait",
                        "--timeout", f"{START_TIMEOUT}s"], capture_output=True, check=False, timeout=START_TIMEOUT + 60)
        kubectl("delete", "namespace", shop, system, "--wait=false", check=False)
