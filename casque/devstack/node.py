"""A Kubernetes node on this machine for tests: containerd, a kubelet, and the controllers.

`start_node` runs, beside an API server that `start_kube_api(..., for_node=True)` started,
everything that makes pods run: containerd (Debian's, with its own root, state, socket and
CNI configuration, so a podman or containerd of the host is untouched), the kubelet,
kube-scheduler, kube-controller-manager (Deployments, ServiceAccounts, Endpoints, namespace
deletion), kube-proxy (the ``kubernetes`` Service, which in-cluster clients dial) and CoreDNS
as the cluster's DNS on the node's address (StatefulSet pods find each other by their stable
names, ``<pod>.<service>.<namespace>.svc.cluster.local``) and kube-router's firewall alone
(its network policy controller: no routes, no service proxy) beside the CNI ``bridge`` plugin,
which enforces no NetworkPolicy itself. Binaries come from ``scripts/install-kube-tools.sh`` and
``scripts/install-node.sh``.

A node changes its host (casque.devstack.node_host keeps the books: a lock for the machine,
what the host had before, putting it back at the stop). A second node (`start_second_node`)
joins the first's cluster in network and mount namespaces of its own
(casque.devstack.node_namespaces), where its kube-proxy and firewall keep their chains and its
kubelet its fixed paths; it changes nothing else on the host and stops before the first.

Pods are deleted through the API before the kubelet stops, so the kubelet stops their
sandboxes (and with them their network namespaces and CNI addresses) itself.

Root lacks CAP_SYS_RESOURCE on the test machines, so no process may lower an
``oom_score_adj``: containerd runs with ``restrict_oom_score_adj`` and the kubelet with
``oomScoreAdj: 0`` (docs/deploy.md, "A real node").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from casque.devstack.kube import (
    SERVICE_CLUSTER_IP_RANGE,
    KubeCluster,
    KubeStartError,
    free_port,
    kube_binary,
    log_tail,
    spawn,
    terminate,
)
from casque.devstack.node_host import (
    BRIDGE,
    BRIDGE_NETFILTER,
    CGROUP_ROOT,
    POD_SUBNET,
    HostBaseline,
    cgroup_hierarchies,
    mounts_under,
    pod_namespaces,
    remove_cgroups,
    shims_of_dead_nodes,
    take_host_lock,
    unmount_under,
    weigh_node_cgroup,
)
from casque.devstack.node_namespaces import NodeNamespaces, NodeNetwork, clear_dead_namespaces

log = logging.getLogger(__name__)

__all__ = ["INSTALL_SCRIPT", "NODE_NAME", "SECOND_NODE_NAME", "KubeNode", "host_address", "missing_node_tools",
           "start_node", "start_second_node"]

INSTALL_SCRIPT = "scripts/install-node.sh"
NODE_NAME = "casque-node"
# Every node's pod subnet is in it: kube-proxy masquerades what comes from outside it.
CLUSTER_CIDR = "10.244.0.0/16"
SECOND_NODE_NAME = "casque-node-2"
# The second node's namespaces (casque.devstack.node_namespaces): its pods on a subnet and a
# bridge of their own, behind a veth pair on a /30 of its own.
SECOND_NETWORK = NodeNetwork(namespace=SECOND_NODE_NAME, host_link="casque-n2-host", node_link="casque-n2",
                             link_subnet="10.245.0.0/30", pod_subnet="10.244.1.0/24")
CNI_BIN_DIR = "/usr/lib/cni"
CLUSTER_DOMAIN = "cluster.local"
# The kubelet gives pods only addresses for their nameservers, so CoreDNS serves port 53.
DNS_PORT = 53
# kube-router's top chains, which its built-in chains jump to once its firewall is in place.
FIREWALL_CHAINS = {"INPUT": "KUBE-ROUTER-INPUT", "FORWARD": "KUBE-ROUTER-FORWARD", "OUTPUT": "KUBE-ROUTER-OUTPUT"}
NODE_TOOLS = ("containerd", "ctr", "runc", "ipset")


def missing_node_tools() -> list[str]:
    """What ``scripts/install-node.sh`` installs and this machine lacks."""
    missing = [tool for tool in NODE_TOOLS if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    missing += [f"{CNI_BIN_DIR}/{p}" for p in ("bridge", "host-local", "loopback") if not Path(CNI_BIN_DIR, p).exists()]
    return missing


def host_address() -> str:
    """The address of the interface of the default route: pods reach the host on it."""
    routes = subprocess.run(["ip", "-j", "route", "get", "1.1.1.1"], capture_output=True, text=True, check=True)
    return str(json.loads(routes.stdout)[0]["prefsrc"])


# --- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeLayout:
    """What differs between the nodes on one machine."""

    name: str
    bridge: str
    pod_subnet: str
    cgroup_root: str


FIRST_LAYOUT = NodeLayout(NODE_NAME, BRIDGE, POD_SUBNET, CGROUP_ROOT)
SECOND_LAYOUT = NodeLayout(SECOND_NODE_NAME, "casque1", SECOND_NETWORK.pod_subnet, SECOND_NODE_NAME)


def containerd_config(directory: Path, sandbox_image: str) -> str:
    state = directory / "containerd-state"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""\
version = 2
root = "{directory / 'containerd-root'}"
state = "{state}"

[grpc]
  address = "{socket_path(directory)}"

[ttrpc]
  address = "{state / 'containerd.sock.ttrpc'}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{directory / 'containerd-opt'}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  # Root here lacks CAP_SYS_RESOURCE: a sandbox's -998 (or a Guaranteed pod's -997) cannot be
  # set, and runc fails to start the container. This keeps scores at containerd's own or above.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{state / 'runc'}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{directory / 'cni'}"
"""


def cni_config(directory: Path, layout: NodeLayout = FIRST_LAYOUT) -> str:
    # No ipMasq and no portmap plugin: pods only talk to the host, whose address is local to
    # it, so no NAT rule is needed, and the CNI plugins add no iptables rules of their own.
    return json.dumps({
        "cniVersion": "1.0.0",
        "name": "casque-node",
        "plugins": [{
            "type": "bridge",
            "bridge": layout.bridge,
            "isGateway": True,
            "ipMasq": False,
            "hairpinMode": True,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": layout.pod_subnet}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(directory / "cni-ipam"),
            },
        }],
    }, indent=2)


def corefile(address: str, kubeconfig: Path, ready_port: int) -> str:
    """CoreDNS on the node's address: the cluster's names from the API server, the rest
    forwarded to the host's resolver, and readiness (the API server's Services and endpoints
    read once) on a loopback port."""
    return f"""\
.:{DNS_PORT} {{
    bind {address}
    errors
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    forward . /etc/resolv.conf
    cache 5
}}
"""


def kubelet_config(directory: Path, address: str, port: int, ca_file: Path, layout: NodeLayout = FIRST_LAYOUT,
                   dns_address: str | None = None) -> str:
    """The kubelet's configuration; its pods' nameserver is CoreDNS on `dns_address` (the
    first node's address, where it runs), by default this node's own."""
    # JSON is YAML: the kubelet reads it as its configuration file.
    return json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": address,
        "port": port,
        "readOnlyPort": 0,
        "healthzPort": 0,
        # Only the API server holds a client certificate of the cluster's CA.
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca_file)}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{layout.cgroup_root}",
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "oomScoreAdj": 0,
        "containerRuntimeEndpoint": f"unix://{socket_path(directory)}",
        "podLogsDir": str(directory / "pod-logs"),
        "resolvConf": "/etc/resolv.conf",
        # CoreDNS, started with the first node, on its address.
        "clusterDNS": [dns_address or address],
        "clusterDomain": CLUSTER_DOMAIN,
        "serializeImagePulls": False,
        "maxPods": 30,
        # The shared disk may be fuller than the defaults allow; the node's pods are small.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
    }, indent=2)


def socket_path(directory: Path) -> Path:
    return directory / "containerd-state" / "containerd.sock"


# --- the running node ---------------------------------------------------------------------------


@dataclass
class KubeNode:
    """The node's processes, and how to stop them and undo what they changed."""

    directory: Path
    cluster: KubeCluster
    address: str
    # The first node's: what the host had before, and the machine's node lock. A second node
    # changes only its own namespaces (`namespaces`), and is stopped before the first.
    baseline: HostBaseline | None
    lock: IO[bytes] | None
    layout: NodeLayout = FIRST_LAYOUT
    namespaces: NodeNamespaces | None = None
    processes: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.layout.name

    def enter(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run on this node: in its namespaces, if it has its own."""
        return list(argv) if self.namespaces is None else self.namespaces.enter(argv)

    def ctr(self, *args: str) -> list[str]:
        return ["ctr", "--address", str(socket_path(self.directory)), "--namespace", "k8s.io", *args]

    def import_image(self, image: str) -> None:
        """Copy an image from podman's store into the node's containerd."""
        with tempfile.TemporaryFile() as errors:
            save = subprocess.Popen(["podman", "save", "--format", "docker-archive", image], stdout=subprocess.PIPE,
                                    stderr=errors)
            assert save.stdout is not None
            imported = subprocess.run(self.ctr("images", "import", "-"), stdin=save.stdout, capture_output=True,
                                      text=True, check=False)
            save.stdout.close()
            saved = save.wait()
            errors.seek(0)
            # When podman fails, what ctr says of the truncated archive only hides why.
            if saved != 0:
                raise KubeStartError(f"could not save {image} from podman's store: "
                                     f"{errors.read().decode(errors='replace').strip()}")
        if imported.returncode != 0:
            raise KubeStartError(f"could not import {image} into the node's containerd: {imported.stderr}")

    def log(self, name: str) -> Path:
        return self.directory / f"{name}.log"

    def running(self) -> list[str]:
        return [name for name, process, _ in self.processes if process.poll() is None]

    def _stop(self, name: str, timeout: float = 20.0) -> None:
        for each, process, _ in self.processes:
            if each == name:
                terminate(process, timeout)

    def stop(self, drain: Callable[[], None] | None = None) -> list[str]:
        """Stop the node and undo its host changes; what is left, one line each.

        `drain` is called with the controllers stopped and the kubelet running: it deletes the
        pods and waits until they are gone, so that the kubelet stops their sandboxes."""
        try:
            for name in ("kube-controller-manager", "kube-scheduler"):
                self._stop(name)
            if drain is not None and "kubelet" in self.running():
                drain()
            for name in ("kube-router", "kubelet", "kube-proxy", "coredns"):
                self._stop(name)
            self._remove_containers()
            self._stop("containerd")
            if self.namespaces is not None:
                # Its mounts go with its mount namespace, its chains, bridge and pair with its network.
                self.namespaces.stop()
                for hierarchy in cgroup_hierarchies():
                    remove_cgroups(hierarchy / self.layout.cgroup_root)
                subprocess.run([*self.cluster.kubectl_args(), "delete", "node", self.name, "--wait=false"],
                               capture_output=True, check=False)
            unmount_under(self.directory)
            left = [] if self.baseline is None else self.baseline.restore(self.directory)
            left += [f"mount {point}" for point in mounts_under(self.directory)]
            if self.namespaces is not None:
                network = self.namespaces.network
                left += [f"network namespace {network.namespace}"] if network.exists() else []
                left += [f"cgroup {h / self.layout.cgroup_root}" for h in cgroup_hierarchies()
                         if (h / self.layout.cgroup_root).exists()]
            return left
        finally:
            if self.lock is not None:
                self.lock.close()

    def _remove_containers(self) -> None:
        """What the kubelet left in containerd (sandboxes of pods the drain did not reach)."""
        if "containerd" not in self.running():
            return
        listing = subprocess.run(self.ctr("containers", "list", "--quiet"), capture_output=True, text=True,
                                 check=False)
        for container in listing.stdout.split():
            subprocess.run(self.ctr("tasks", "kill", "--signal", "SIGKILL", container), capture_output=True,
                           check=False)
            subprocess.run(self.ctr("tasks", "delete", "--force", container), capture_output=True, check=False)
            subprocess.run(self.ctr("containers", "delete", container), capture_output=True, check=False)


def clear_dead_node() -> None:
    """Undo what a node killed before it could stop (kill -9 of its test session) left on the
    host, before a new one starts; called with the host lock held, so no node is running.
    Its pods' network namespaces would keep their addresses on the bridge, and the new node's
    pods, numbered from the subnet's start again, would get the same ones. A second node's
    namespaces hold all of its own."""
    clear_dead_namespaces([SECOND_NETWORK])
    for pid in shims_of_dead_nodes():
        log.warning("stopping containerd shim %d of a node that is gone", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for name in pod_namespaces():
        log.warning("removing network namespace %s of a node that is gone", name)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        log.warning("removing the bridge %s of a node that is gone", BRIDGE)
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)


def _wait_for(what: str, ready: Callable[[], bool], node: KubeNode, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for name, process, log in node.processes:
            if process.poll() is not None:
                raise KubeStartError(f"{name} exited with code {process.returncode} while waiting for {what}; "
                                     f"log: {log}\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise KubeStartError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def _serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def firewall_in_place(node: KubeNode) -> bool:
    """kube-router's firewall is in the path of the node's pods' packets: INPUT, FORWARD and
    OUTPUT jump to its chains, and its default policy chain marks what no NetworkPolicy
    selects. It makes them before its first sync, and syncs again on every change of a pod,
    namespace or policy."""
    def listing(chain: str) -> str:
        return subprocess.run(node.enter(["iptables", "-w", "-t", "filter", "-S", chain]), capture_output=True,
                              text=True, check=False).stdout

    if any(f"-j {target}" not in listing(chain) for chain, target in FIREWALL_CHAINS.items()):
        return False
    return "MARK" in listing("KUBE-NWPLCY-DEFAULT")


def _node_ready(cluster: KubeCluster, name: str) -> bool:
    result = subprocess.run([*cluster.kubectl_args(), "get", "node", name, "-o", "json"],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return False
    conditions = json.loads(result.stdout).get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def start_node(
    cluster: KubeCluster,
    directory: Path,
    address: str,
    sandbox_image: str,
    sandbox_archive: Callable[[KubeNode], None],
    timeout: float = 120.0,
    lock_timeout: float = 900.0,
) -> KubeNode:
    """Start containerd, the kubelet and the controllers for `cluster`, wait until the node is
    Ready. `sandbox_archive` puts `sandbox_image` into the node's containerd (it runs after
    containerd starts, before the kubelet)."""
    if missing := missing_node_tools():
        raise KubeStartError(f"{', '.join(missing)} missing; run `bash {INSTALL_SCRIPT}`")
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    lock = take_host_lock(lock_timeout)
    try:
        clear_dead_node()
        baseline = HostBaseline.record()
    except BaseException:
        lock.close()
        raise
    node = KubeNode(directory=directory, cluster=cluster, address=address, baseline=baseline, lock=lock)
    try:
        _start_runtime(node, sandbox_image, sandbox_archive)
        ready_port = free_port()
        (directory / "Corefile").write_text(corefile(address, cluster.kubeconfig_path, ready_port))
        _spawn(node, "coredns", [str(kube_binary("coredns")), "-conf", str(directory / "Corefile")])
        _wait_for("CoreDNS ready", lambda: _serving(f"http://127.0.0.1:{ready_port}/ready"), node, 60)
        _start_kubelet_and_proxy(node, sandbox_image, dns_address=address)
        _start_controllers(node)
        _wait_for(f"node {node.name} Ready", lambda: _node_ready(cluster, node.name), node, timeout)
        _start_firewall(node)
    except BaseException:
        node.stop()
        raise
    return node


def start_second_node(
    first: KubeNode,
    directory: Path,
    sandbox_image: str,
    sandbox_archive: Callable[[KubeNode], None],
    timeout: float = 120.0,
) -> KubeNode:
    """A second node of `first`'s cluster, in namespaces of its own (casque.devstack.node_namespaces):
    its containerd, kubelet, kube-proxy and firewall; the scheduler, the controllers and CoreDNS
    are the first node's. Stop it before the first."""
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    namespaces = NodeNamespaces.start(SECOND_NETWORK, directory)
    node = KubeNode(directory=directory, cluster=first.cluster, address=SECOND_NETWORK.node_address, baseline=None,
                    lock=None, layout=SECOND_LAYOUT, namespaces=namespaces)
    try:
        _start_runtime(node, sandbox_image, sandbox_archive)
        _start_kubelet_and_proxy(node, sandbox_image, dns_address=first.address)
        _wait_for(f"node {node.name} Ready", lambda: _node_ready(node.cluster, node.name), node, timeout)
        _start_firewall(node)
    except BaseException:
        node.stop()
        raise
    return node


def _spawn(node: KubeNode, name: str, argv: Sequence[str]) -> None:
    node.processes.append((name, spawn(node.enter(argv), node.log(name)), node.log(name)))


def _start_runtime(node: KubeNode, sandbox_image: str, sandbox_archive: Callable[[KubeNode], None]) -> None:
    """containerd, with the CNI configuration of the node's bridge and subnet, and the sandbox image."""
    directory = node.directory
    (directory / "cni").mkdir(exist_ok=True)
    (directory / "cni" / "10-casque-node.conflist").write_text(cni_config(directory, node.layout))
    (directory / "containerd.toml").write_text(containerd_config(directory, sandbox_image))
    for hierarchy in cgroup_hierarchies():
        # The kubelet wants its cgroup root to exist in every hierarchy.
        (hierarchy / node.layout.cgroup_root).mkdir(exist_ok=True)
    weigh_node_cgroup(node.layout.cgroup_root, os.cpu_count() or 1)
    _spawn(node, "containerd", ["containerd", "--config", str(directory / "containerd.toml")])
    _wait_for("containerd", lambda: subprocess.run(node.ctr("version"), capture_output=True).returncode == 0,
              node, 30)
    sandbox_archive(node)


def _start_kubelet_and_proxy(node: KubeNode, sandbox_image: str, dns_address: str) -> None:
    directory, address, kubeconfig = node.directory, node.address, str(node.cluster.kubeconfig_path)
    (directory / "kubelet.json").write_text(kubelet_config(directory, address, free_port(), node.cluster.ca_cert_path,
                                                           node.layout, dns_address))
    _spawn(node, "kubelet", [
        str(kube_binary("kubelet")), f"--config={directory / 'kubelet.json'}", f"--kubeconfig={kubeconfig}",
        f"--root-dir={directory / 'kubelet'}", f"--cert-dir={directory / 'kubelet-pki'}",
        f"--hostname-override={node.name}", f"--node-ip={address}",
        f"--volume-plugin-dir={directory / 'volume-plugins'}",
        f"--pod-infra-container-image={sandbox_image}", "--v=1",
    ])
    _spawn(node, "kube-proxy", [
        str(kube_binary("kube-proxy")), f"--kubeconfig={kubeconfig}", f"--hostname-override={node.name}",
        "--proxy-mode=iptables", f"--cluster-cidr={CLUSTER_CIDR}", f"--nodeport-addresses={address}/32",
        # Leave the host's sysctls alone: no route_localnet for NodePorts on 127.0.0.1 (and so
        # no rule dropping outside traffic to 127.0.0.0/8), no conntrack table sizes.
        "--iptables-localhost-nodeports=false", "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0s", "--conntrack-tcp-timeout-close-wait=0s",
        f"--metrics-bind-address=127.0.0.1:{free_port()}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
    ])


def _start_controllers(node: KubeNode) -> None:
    """The scheduler and the controllers, with the first node: one of each for the cluster."""
    kubeconfig, pki = str(node.cluster.kubeconfig_path), node.cluster.ca_cert_path.parent
    _spawn(node, "kube-scheduler", [
        str(kube_binary("kube-scheduler")), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
        "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
    ])
    _spawn(node, "kube-controller-manager", [
        str(kube_binary("kube-controller-manager")), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
        "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        f"--root-ca-file={node.cluster.ca_cert_path}", f"--service-account-private-key-file={pki / 'sa.key'}",
        "--use-service-account-credentials=false", "--controllers=*,-nodeipam,-cloud-node-lifecycle",
        "--concurrent-deployment-syncs=2", "--concurrent-replicaset-syncs=2",
        # HorizontalPodAutoscalers act within seconds rather than 15 s.
        "--horizontal-pod-autoscaler-sync-period=5s",
    ])


def _start_firewall(node: KubeNode) -> None:
    """kube-router's network policy controller: it reads the node's address from the Node, so
    it starts once the kubelet has registered it."""
    if node.namespaces is None:
        bridge_netfilter = Path("/proc/sys") / BRIDGE_NETFILTER
        if not bridge_netfilter.exists():
            raise KubeStartError(f"{bridge_netfilter} is missing: the kernel has no br_netfilter, so packets "
                                 "between pods on the bridge bypass iptables and no NetworkPolicy would hold")
        if bridge_netfilter.read_text().strip() != "1":
            bridge_netfilter.write_text("1")  # put back by HostBaseline.restore
    # (A node in a network namespace of its own has it set there: NodeNetwork.create.)
    _spawn(node, "kube-router", firewall_command(kube_binary("kube-router"), node.cluster.kubeconfig_path, node.name))
    _wait_for("kube-router's firewall", lambda: firewall_in_place(node), node, 60)


def firewall_command(binary: Path, kubeconfig: Path, node_name: str = NODE_NAME) -> list[str]:
    """kube-router with its network policy controller alone: no routes or BGP (the bridge
    connects the pods), no service proxy (kube-proxy is it)."""
    return [
        str(binary), f"--kubeconfig={kubeconfig}", f"--hostname-override={node_name}",
        "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
        # Its exemption for Service addresses must name the API server's range.
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        # No ports of its own: the health server would listen on every address (readiness is
        # its chains, firewall_in_place), and metrics are off by default.
        "--health-port=0", "--metrics-port=0", "--v=1",
    ]


def wait_pods_gone(cluster: KubeCluster, timeout: float = 120.0, node: str | None = None) -> None:
    """Delete every pod (of `node`, if given; its grace period cut to 1 s) and wait until none is left."""
    kubectl = cluster.kubectl_args()
    on_node = [f"--field-selector=spec.nodeName={node}"] if node else []
    subprocess.run([*kubectl, "delete", "pods", "--all", "--all-namespaces", *on_node, "--grace-period=1",
                    "--wait=false"], capture_output=True, check=False)
    deadline = time.monotonic() + timeout
    while True:
        listing = subprocess.run([*kubectl, "get", "pods", "--all-namespaces", *on_node, "-o", "name"],
                                 capture_output=True, text=True, check=False)
        if listing.returncode == 0 and not listing.stdout.strip():
            return
        if time.monotonic() > deadline:
            raise KubeStartError(f"pods still there after {timeout:.0f}s: {listing.stdout}")
        time.sleep(0.5)
