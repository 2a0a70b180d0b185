"""`helm upgrade` from the baseline release to main, and `helm rollback`, on the node under
traffic: the chart and images of the baseline (tests.fixtures.releases, built from its tree)
installed first, main's over them, then the baseline's again, while injected pods publish and
consume through their sidecars (tests/fixtures/node_apps.py).

An upgrade leaves the pods that run as they are: their sidecars are the release that injected
them. New pods get the sidecar of the operator that admits them, so a group holds both
versions until the old pods are replaced. The test replaces them itself, one at a time and as
a rolling update does (the leaving member's app stops on SIGTERM and its sidecar after it),
rather than through a Deployment, whose replaced pods would take their logs, and with them
the history, away.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from casque.devstack.kube import KubeCluster, kube_binary
from casque.devstack.node import KubeNode
from casque.devstack.stack import Stack
from casque.engine import protocol
from tests.fixtures.node import NodeImages
from tests.fixtures.node_apps import HISTORY_RESOURCES, HistoryTraffic, host_stack_values, sidecar_image
from tests.fixtures.node_release import CHART, START_TIMEOUT, Kubectl, run
from tests.fixtures.releases import BASELINE, release_home
from tests.fixtures.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(START_TIMEOUT * 6 + 900)]

# Per publisher pod: one in each of the three stages (baseline, upgraded, rolled back), each
# publishing for over a minute so that the next stage's changes meet it running.
MESSAGES = 300
RATE = 4


def casque_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """main's `casque` against the release's backends (the node's stack)."""
    return subprocess.run([sys.executable, "-m", "casque.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def group_members(env: dict[str, str]) -> list[int]:
    """The protocol of every member of the installation's groups (`casque protocol show`)."""
    shown = casque_cli(env, "protocol", "show", "-o", "json")
    assert shown.returncode == 0, shown.stderr
    return sorted(member["protocol"] for member in json.loads(shown.stdout)["members"])


def await_members(env: dict[str, str], protocols: list[int]) -> None:
    """The groups' members are `protocols`: one that left is gone once its sidecar closed its
    session, one that joined is there once it registered."""
    wait_for(f"members speaking {protocols}", lambda: group_members(env) == protocols, timeout=START_TIMEOUT)


def test_a_helm_upgrade_from_the_baseline_and_a_rollback_under_traffic_lose_nothing(
    kube_node: KubeNode,
    node_cluster: KubeCluster,
    node_images: NodeImages,
    baseline_node_images: NodeImages,
    node_stack: Stack,
    node_keyspace_and_root: tuple[str, str],
    tmp_path: Path,
) -> None:
    baseline, main = baseline_node_images, node_images
    for image in (baseline.operator, baseline.sidecar):
        kube_node.import_image(image)
    kubectl = Kubectl(node_cluster)
    helm = kube_binary("helm")
    suffix = uuid.uuid4().hex[:8]
    system, shop = f"casque-{suffix}", f"shop-{suffix}"
    keyspace, zk_root = node_keyspace_and_root
    release = ["--namespace", system, "--kubeconfig", str(node_cluster.kubeconfig_path), "--wait",
               "--timeout", f"{START_TIMEOUT}s"]
    values: dict[str, Path] = {}
    for name, images in (("baseline", baseline), ("main", main)):
        values[name] = tmp_path / f"{name}.yaml"
        values[name].write_text(yaml.safe_dump(host_stack_values(images, node_stack, keyspace, zk_root)))
    env = {**os.environ, "CASQUE_CASSANDRA_CONTACT_POINTS": ",".join(node_stack.contact_points),
           "CASQUE_CASSANDRA_PORT": str(node_stack.ports.native), "CASQUE_KEYSPACE": keyspace,
           "CASQUE_ZOOKEEPER_HOSTS": node_stack.zookeeper_hosts, "CASQUE_ZOOKEEPER_ROOT": zk_root}
    traffic = HistoryTraffic(kubectl, kube_node, shop)

    def operator_is(image: str) -> None:
        """helm's --wait saw the Deployment available; the old operator pod may still serve the
        webhook while it terminates. Wait until only `image`'s pods are left, all Ready."""
        def only() -> bool:
            pods: list[dict[str, Any]] = kubectl.json("pods", "-n", system, "-l",
                                                      "app.kubernetes.io/name=casque")["items"]
            return bool(pods) and all(
                pod["spec"]["containers"][0]["image"] == image and pod["metadata"].get("deletionTimestamp") is None
                and all(s["ready"] for s in pod["status"].get("containerStatuses", [{"ready": False}]))
                for pod in pods)
        wait_for(f"the operator of {image} alone", only, timeout=START_TIMEOUT)

    def resources_ready() -> None:
        kubectl("wait", "-n", shop, "--for=condition=Ready", "queue/history", "subscriber/checker",
                f"--timeout={START_TIMEOUT}s")

    try:
        run(helm, "install", "casque", release_home(BASELINE) / "src" / "helm" / "casque", "--create-namespace",
            *release, "-f", values["baseline"])
        operator_is(baseline.operator)
        kubectl("create", "namespace", shop)
        kubectl("apply", "-n", shop, "-f", "-", stdin=HISTORY_RESOURCES)
        resources_ready()
        assert sidecar_image(traffic.start_consumer("consumer-a", main.worker)) == baseline.sidecar
        traffic.start_publisher("publisher-a", main.worker, MESSAGES, RATE, prefix="a")
        traffic.progress_after(f"the start on {BASELINE}")

        # The upgrade: main's chart and operator; the pods keep the baseline's sidecars.
        run(helm, "upgrade", "casque", CHART, *release, "-f", values["main"])
        operator_is(main.operator)
        resources_ready()  # main's operator took over what the baseline's made
        traffic.start_publisher("publisher-b", main.worker, MESSAGES, RATE, prefix="b")
        traffic.progress_after("helm upgrade")

        # The rolling part: a pod of main joins the group, then the baseline's leaves.
        assert sidecar_image(traffic.start_consumer("consumer-b", main.worker)) == main.sidecar
        traffic.progress_after("a member of main joined")
        await_members(env, [protocol.BASELINE, protocol.PROTOCOL])
        refused = casque_cli(env, "protocol", "set", str(protocol.PROTOCOL))
        assert refused.returncode == 1 and "sidecar(s) speak less" in refused.stderr, refused.stdout + refused.stderr
        traffic.stop_consumer("consumer-a")
        traffic.progress_after(f"the member of {BASELINE} left")
        await_members(env, [protocol.PROTOCOL])

        # The rollback: the baseline's operator again, and its sidecars over what main wrote.
        run(helm, "rollback", "casque", "1", *release)
        operator_is(baseline.operator)
        resources_ready()
        traffic.start_publisher("publisher-c", main.worker, MESSAGES, RATE, prefix="c")
        assert sidecar_image(traffic.start_consumer("consumer-c", main.worker)) == baseline.sidecar
        traffic.progress_after(f"a member of {BASELINE} joined again")
        traffic.stop_consumer("consumer-b")
        traffic.progress_after("the member of main left")

        traffic.checked_when_whole()
        await_members(env, [protocol.BASELINE])  # consumer-c, in its group
        assert protocol.BASELINE == json.loads(casque_cli(env, "protocol", "show", "-o", "json").stdout)["version"]
    except BaseException:
        kubectl.show(system, shop)
        raise
    finally:
        kubectl("delete", "-n", shop, "pods", "--all", "--grace-period=1", f"--timeout={START_TIMEOUT}s", check=False)
        kubectl("delete", "-n", shop, "subscribers,queues", "--all", f"--timeout={START_TIMEOUT}s", check=False)
        kubectl("delete", "namespace", shop, "--wait=false", check=False)
        subprocess.run([str(helm), "uninstall", "casque", *release], capture_output=True, check=False,
                       timeout=START_TIMEOUT + 60)
        kubectl("delete", "namespace", system, "--wait=false", check=False)

