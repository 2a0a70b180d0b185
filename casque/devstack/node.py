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

A node changes its host, and these machines are shared with other test sessions, so it takes
a lock for the host (one node per machine) and `KubeNode.stop` undoes what it can:

- iptables: the chains that did not exist before the node started (kube-proxy's ``KUBE-*``,
  kube-router's ``KUBE-ROUTER-*``, ``KUBE-NWPLCY-*`` and ``KUBE-POD-FW-*``) and the rules that
  jump to them; the kubelet makes none of its own (``makeIPTablesUtilChains: false``), so no
  ``KUBE-FIREWALL`` rule drops traffic to 127.0.0.0/8 from other addresses;
- ipsets: those kube-router made (the pods each policy selects), once no rule names them;
- the sysctls the kubelet sets (``vm.overcommit_memory``, ``kernel.panic`` and others), and
  ``net.bridge.bridge-nf-call-iptables`` when the node had to turn it on: put back to what they
  were;
- the pods' bridge ``casque0`` (the CNI ``bridge`` plugin, no masquerading, no port maps);
- the kubelet's cgroups, all under ``/casque-node`` in each cgroup v1 hierarchy;
- mounts under the node's directory (the kubelet bind-mounts its root directory onto
  itself, and volumes onto pods' directories), and the directories outside it that the
  kubelet and containerd create at fixed paths, when the node created them.

Pods are deleted through the API before the kubelet stops, so the kubelet stops their
sandboxes (and with them their network namespaces and CNI addresses) itself.

Root lacks CAP_SYS_RESOURCE on the test machines, so no process may lower an
``oom_score_adj``: containerd runs with ``restrict_oom_score_adj`` and the kubelet with
``oomScoreAdj: 0`` (docs/deploy.md, "A real node").
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import shlex
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

log = logging.getLogger(__name__)

__all__ = ["INSTALL_SCRIPT", "NODE_NAME", "KubeNode", "host_address", "missing_node_tools", "start_node"]

INSTALL_SCRIPT = "scripts/install-node.sh"
NODE_NAME = "casque-node"
BRIDGE = "casque0"
POD_SUBNET = "10.244.0.0/24"
# Every cgroup the kubelet makes is under this one, in each hierarchy.
CGROUP_ROOT = "casque-node"
CGROUP_MOUNT = Path("/sys/fs/cgroup")
CNI_BIN_DIR = "/usr/lib/cni"
CLUSTER_DOMAIN = "cluster.local"
# The kubelet gives pods only addresses for their nameservers, so CoreDNS serves port 53.
DNS_PORT = 53
# One node per machine: the bridge, the cgroup root and the iptables chains are the host's.
HOST_LOCK = Path("/run/casque-node.lock")
# What the kubelet sets when it starts (pkg/kubelet/cm's kernel defaults).
KUBELET_SYSCTLS = (
    "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
)
# Pods on one bridge talk through it without being routed: only with this on do their packets
# pass iptables, where kube-router's firewall is. Without it a policy holds only between the
# host and pods.
BRIDGE_NETFILTER = "net/bridge/bridge-nf-call-iptables"
NODE_SYSCTLS = (*KUBELET_SYSCTLS, BRIDGE_NETFILTER)
# kube-router's top chains, which its built-in chains jump to once its firewall is in place.
FIREWALL_CHAINS = {"INPUT": "KUBE-ROUTER-INPUT", "FORWARD": "KUBE-ROUTER-FORWARD", "OUTPUT": "KUBE-ROUTER-OUTPUT"}
# Fixed paths outside the node's directory that the kubelet or containerd create.
FIXED_DIRECTORIES = (
    Path("/var/lib/kubelet"),            # the device manager's socket directory
    Path("/var/log/containers"),         # the kubelet's links to container logs
    Path("/run/containerd"),             # containerd's shims' sockets
    Path("/var/run/netns"),              # pods' network namespaces, made by containerd
    Path("/usr/libexec/kubernetes"),
)
IPTABLES_TABLES = ("filter", "nat", "mangle")
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


# --- what the node changes on its host, and putting it back ---------------------------------


def _iptables_chains(command: str) -> dict[str, set[str]]:
    chains: dict[str, set[str]] = {}
    for table in IPTABLES_TABLES:
        listing = subprocess.run([command, "-w", "-t", table, "-S"], capture_output=True, text=True, check=False)
        chains[table] = {line.split()[1] for line in listing.stdout.splitlines() if line.startswith(("-N ", "-P "))}
    return chains


def rules_into(listing: Sequence[str], chains: set[str]) -> list[list[str]]:
    """The rules of an ``iptables -S`` listing, outside `chains`, that name one of them (as
    ``-D`` takes them: the chain, then the rule)."""
    rules = []
    for line in listing:
        # shlex: comments are quoted and hold spaces ("kubernetes service portals").
        words = shlex.split(line)
        if words[:1] == ["-A"] and words[1] not in chains and any(w in chains for w in words[2:]):
            rules.append(words[1:])
    return rules


def _remove_new_chains(command: str, before: dict[str, set[str]]) -> None:
    """Delete the chains that are not in `before`, and first every rule that jumps to them."""
    for table in IPTABLES_TABLES:
        listing = subprocess.run([command, "-w", "-t", table, "-S"], capture_output=True, text=True, check=False)
        lines = listing.stdout.splitlines()
        new = {line.split()[1] for line in lines if line.startswith("-N ")} - before.get(table, set())
        if not new:
            continue
        for rule in rules_into(lines, new):
            subprocess.run([command, "-w", "-t", table, "-D", *rule], capture_output=True, check=False)
        for chain in new:
            subprocess.run([command, "-w", "-t", table, "-F", chain], capture_output=True, check=False)
        for chain in new:
            subprocess.run([command, "-w", "-t", table, "-X", chain], capture_output=True, check=False)


def kube_router_ipsets(names: Sequence[str]) -> set[str]:
    """kube-router's among ipset names (``KUBE-SRC-*``, ``KUBE-DST-*``, ``inet6:``-prefixed for
    IPv6); another program's sets on the host are not the node's to remove."""
    return {name for name in names if name.removeprefix("inet6:").startswith("KUBE-")}


def _ipsets() -> set[str]:
    listing = subprocess.run(["ipset", "list", "-name"], capture_output=True, text=True, check=False)
    return kube_router_ipsets(listing.stdout.split())


def _remove_new_ipsets(before: set[str]) -> None:
    """Destroy the ipsets not in `before`; run after the iptables rules that match them are gone
    (the kernel refuses to destroy a set a rule names)."""
    for name in sorted(_ipsets() - before):
        subprocess.run(["ipset", "destroy", name], capture_output=True, check=False)


def _read_sysctls() -> dict[str, str]:
    values = {}
    for name in NODE_SYSCTLS:
        path = Path("/proc/sys") / name
        if path.exists():
            values[name] = path.read_text().strip()
    return values


def _restore_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        path = Path("/proc/sys") / name
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError:
            pass


def _mounts_under(directory: Path) -> list[str]:
    """Mount points at or under `directory`, deepest first."""
    prefix = str(directory)
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=len, reverse=True)


def _unmount_under(directory: Path) -> None:
    for point in _mounts_under(directory):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


def _cgroup_hierarchies() -> list[Path]:
    if not CGROUP_MOUNT.is_dir():
        return []
    return [p for p in CGROUP_MOUNT.iterdir() if p.is_dir() and (p / "cgroup.procs").exists()]


def _remove_cgroups(root: Path) -> None:
    """Remove a cgroup tree bottom-up (only empty cgroups can go)."""
    if not root.is_dir():
        return
    for directory in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            directory.rmdir()
        except OSError:
            pass
    try:
        root.rmdir()
    except OSError:
        pass


def _remove_fixed_directory(fixed: Path, directory: Path) -> None:
    """Remove `fixed`, which the node created, if nothing but the node's things are in it: links
    into `directory` (the kubelet's links to container logs), and mounts (containerd makes
    /run/netns a mount of its own). Someone else may have started using the path meanwhile."""
    if not fixed.is_dir():
        return
    for link in [p for p in fixed.rglob("*") if p.is_symlink()]:
        if Path(os.readlink(link)).is_relative_to(directory):
            link.unlink()
    if any(p.is_file() or p.is_symlink() for p in fixed.rglob("*")):
        return
    _unmount_under(fixed)
    shutil.rmtree(fixed, ignore_errors=True)


@dataclass
class HostBaseline:
    """What the host had before the node started, so that stop() removes only the node's."""

    iptables: dict[str, dict[str, set[str]]]
    ipsets: set[str]
    sysctls: dict[str, str]
    absent_directories: list[Path]
    bridge_existed: bool

    @classmethod
    def record(cls) -> HostBaseline:
        return cls(
            iptables={command: _iptables_chains(command) for command in ("iptables", "ip6tables")
                      if shutil.which(command)},
            ipsets=_ipsets(),
            sysctls=_read_sysctls(),
            absent_directories=[d for d in FIXED_DIRECTORIES if not d.exists()],
            bridge_existed=Path(f"/sys/class/net/{BRIDGE}").exists(),
        )

    def restore(self, directory: Path) -> list[str]:
        """Undo the node's changes (its own files are in `directory`); what could not be
        undone, one line each."""
        for command, before in self.iptables.items():
            _remove_new_chains(command, before)
        _remove_new_ipsets(self.ipsets)
        _restore_sysctls(self.sysctls)
        if not self.bridge_existed:
            subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        for hierarchy in _cgroup_hierarchies():
            _remove_cgroups(hierarchy / CGROUP_ROOT)
        for fixed in self.absent_directories:
            _remove_fixed_directory(fixed, directory)
        left = [str(fixed) for fixed in self.absent_directories if fixed.exists()]
        if not self.bridge_existed and Path(f"/sys/class/net/{BRIDGE}").exists():
            left.append(f"the bridge {BRIDGE}")
        left += [f"cgroup {h / CGROUP_ROOT}" for h in _cgroup_hierarchies() if (h / CGROUP_ROOT).exists()]
        for command, before in self.iptables.items():
            after = _iptables_chains(command)
            left += [f"{command} -t {t} chain {c}" for t in after for c in sorted(after[t] - before.get(t, set()))]
        left += [f"ipset {name}" for name in sorted(_ipsets() - self.ipsets)]
        return left


# --- configuration ---------------------------------------------------------------------------


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


def cni_config(directory: Path) -> str:
    # No ipMasq and no portmap plugin: pods only talk to the host, whose address is local to
    # it, so no NAT rule is needed, and the CNI plugins add no iptables rules of their own.
    return json.dumps({
        "cniVersion": "1.0.0",
        "name": "casque-node",
        "plugins": [{
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": True,
            "ipMasq": False,
            "hairpinMode": True,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_SUBNET}]],
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


def kubelet_config(directory: Path, address: str, port: int, ca_file: Path) -> str:
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
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "oomScoreAdj": 0,
        "containerRuntimeEndpoint": f"unix://{socket_path(directory)}",
        "podLogsDir": str(directory / "pod-logs"),
        "resolvConf": "/etc/resolv.conf",
        # CoreDNS, started before the kubelet, on the node's own address.
        "clusterDNS": [address],
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
    baseline: HostBaseline
    lock: IO[bytes]
    processes: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return NODE_NAME

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
            _unmount_under(self.directory)
            left = self.baseline.restore(self.directory)
            left += [f"mount {point}" for point in _mounts_under(self.directory)]
            return left
        finally:
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


def _pod_namespaces() -> list[str]:
    """The network namespaces in /var/run/netns that hold an address of the pods' subnet."""
    subnet = ipaddress.ip_network(POD_SUBNET)
    found = []
    for name in sorted(os.listdir("/var/run/netns")) if Path("/var/run/netns").is_dir() else []:
        shown = subprocess.run(["ip", "-netns", name, "-4", "-o", "addr", "show"], capture_output=True, text=True,
                               check=False)
        addresses = [word.split("/")[0] for line in shown.stdout.splitlines() for word in line.split()[3:4]]
        if any(ipaddress.ip_address(a) in subnet for a in addresses):
            found.append(name)
    return found


def _shims_of_dead_nodes() -> list[int]:
    """containerd shims of the node's namespace (`k8s.io`) left running after their node's
    containerd is gone: their sockets (`-address`) answer no more."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"containerd-shim-runc-v2") or b"k8s.io" not in argv:
            continue
        address = argv[argv.index(b"-address") + 1].decode() if b"-address" in argv else ""
        if address and not Path(address).exists():
            pids.append(int(proc.name))
    return pids


def clear_dead_node() -> None:
    """Undo what a node killed before it could stop (kill -9 of its test session) left on the
    host, before a new one starts; called with the host lock held, so no node is running.
    Its pods' network namespaces would keep their addresses on the bridge, and the new node's
    pods, numbered from the subnet's start again, would get the same ones."""
    for pid in _shims_of_dead_nodes():
        log.warning("stopping containerd shim %d of a node that is gone", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for name in _pod_namespaces():
        log.warning("removing network namespace %s of a node that is gone", name)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        log.warning("removing the bridge %s of a node that is gone", BRIDGE)
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)


def _take_host_lock(timeout: float) -> IO[bytes]:
    """The machine's node lock; another session's node is waited out for up to `timeout`."""
    lock = open(HOST_LOCK, "wb")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                lock.close()
                raise KubeStartError(f"another test session has run a node on this machine for {timeout:.0f}s "
                                     f"({HOST_LOCK} is held)") from None
            time.sleep(1.0)


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


def firewall_in_place() -> bool:
    """kube-router's firewall is in the path of the pods' packets: INPUT, FORWARD and OUTPUT
    jump to its chains, and its default policy chain marks what no NetworkPolicy selects. It
    makes them before its first sync, and syncs again on every change of a pod, namespace or
    policy."""
    for chain, target in FIREWALL_CHAINS.items():
        rules = subprocess.run(["iptables", "-w", "-t", "filter", "-S", chain], capture_output=True, text=True,
                               check=False)
        if f"-j {target}" not in rules.stdout:
            return False
    default = subprocess.run(["iptables", "-w", "-t", "filter", "-S", "KUBE-NWPLCY-DEFAULT"], capture_output=True,
                             text=True, check=False)
    return "MARK" in default.stdout


def _node_ready(cluster: KubeCluster) -> bool:
    result = subprocess.run([*cluster.kubectl_args(), "get", "node", NODE_NAME, "-o", "json"],
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
    lock = _take_host_lock(lock_timeout)
    try:
        clear_dead_node()
        baseline = HostBaseline.record()
    except BaseException:
        lock.close()
        raise
    node = KubeNode(directory=directory, cluster=cluster, address=address, baseline=baseline, lock=lock)
    try:
        _start(node, sandbox_image, sandbox_archive, timeout)
    except BaseException:
        node.stop()
        raise
    return node


def _start(node: KubeNode, sandbox_image: str, sandbox_archive: Callable[[KubeNode], None],
           timeout: float) -> None:
    directory, cluster, address = node.directory, node.cluster, node.address
    (directory / "cni").mkdir(exist_ok=True)
    (directory / "cni" / "10-casque-node.conflist").write_text(cni_config(directory))
    (directory / "containerd.toml").write_text(containerd_config(directory, sandbox_image))
    for hierarchy in _cgroup_hierarchies():
        # The kubelet wants its cgroup root to exist in every hierarchy.
        (hierarchy / CGROUP_ROOT).mkdir(exist_ok=True)

    def start(name: str, argv: Sequence[str]) -> None:
        node.processes.append((name, spawn(list(argv), node.log(name)), node.log(name)))

    start("containerd", ["containerd", "--config", str(directory / "containerd.toml")])
    _wait_for("containerd", lambda: subprocess.run(node.ctr("version"), capture_output=True).returncode == 0,
              node, 30)
    sandbox_archive(node)

    kubeconfig = str(cluster.kubeconfig_path)
    ready_port = free_port()
    (directory / "Corefile").write_text(corefile(address, cluster.kubeconfig_path, ready_port))
    start("coredns", [str(kube_binary("coredns")), "-conf", str(directory / "Corefile")])
    _wait_for("CoreDNS ready", lambda: _serving(f"http://127.0.0.1:{ready_port}/ready"), node, 60)
    (directory / "kubelet.json").write_text(kubelet_config(directory, address, free_port(), cluster.ca_cert_path))
    start("kubelet", [
        str(kube_binary("kubelet")), f"--config={directory / 'kubelet.json'}", f"--kubeconfig={kubeconfig}",
        f"--root-dir={directory / 'kubelet'}", f"--cert-dir={directory / 'kubelet-pki'}",
        f"--hostname-override={NODE_NAME}", f"--node-ip={address}",
        f"--volume-plugin-dir={directory / 'volume-plugins'}",
        f"--pod-infra-container-image={sandbox_image}", "--v=1",
    ])
    start("kube-proxy", [
        str(kube_binary("kube-proxy")), f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
        "--proxy-mode=iptables", f"--cluster-cidr={POD_SUBNET}", f"--nodeport-addresses={address}/32",
        # Leave the host's sysctls alone: no route_localnet for NodePorts on 127.0.0.1 (and so
        # no rule dropping outside traffic to 127.0.0.0/8), no conntrack table sizes.
        "--iptables-localhost-nodeports=false", "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0s", "--conntrack-tcp-timeout-close-wait=0s",
        f"--metrics-bind-address=127.0.0.1:{free_port()}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
    ])
    start("kube-scheduler", [
        str(kube_binary("kube-scheduler")), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
        "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
    ])
    pki = cluster.ca_cert_path.parent
    start("kube-controller-manager", [
        str(kube_binary("kube-controller-manager")), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
        "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        f"--root-ca-file={cluster.ca_cert_path}", f"--service-account-private-key-file={pki / 'sa.key'}",
        "--use-service-account-credentials=false", "--controllers=*,-nodeipam,-cloud-node-lifecycle",
        "--concurrent-deployment-syncs=2", "--concurrent-replicaset-syncs=2",
        # HorizontalPodAutoscalers act within seconds rather than 15 s.
        "--horizontal-pod-autoscaler-sync-period=5s",
    ])
    _wait_for(f"node {NODE_NAME} Ready", lambda: _node_ready(cluster), node, timeout)
    _start_firewall(node, start)


def _start_firewall(node: KubeNode, start: Callable[[str, Sequence[str]], None]) -> None:
    """kube-router's network policy controller: it reads the node's address from the Node, so
    it starts once the kubelet has registered it."""
    bridge_netfilter = Path("/proc/sys") / BRIDGE_NETFILTER
    if not bridge_netfilter.exists():
        raise KubeStartError(f"{bridge_netfilter} is missing: the kernel has no br_netfilter, so packets between "
                             "pods on the bridge bypass iptables and no NetworkPolicy would hold")
    if bridge_netfilter.read_text().strip() != "1":
        bridge_netfilter.write_text("1")  # put back by HostBaseline.restore
    start("kube-router", firewall_command(kube_binary("kube-router"), node.cluster.kubeconfig_path))
    _wait_for("kube-router's firewall", firewall_in_place, node, 60)


def firewall_command(binary: Path, kubeconfig: Path) -> list[str]:
    """kube-router with its network policy controller alone: no routes or BGP (the bridge
    connects the pods), no service proxy (kube-proxy is it)."""
    return [
        str(binary), f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
        "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
        # Its exemption for Service addresses must name the API server's range.
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        # No ports of its own: the health server would listen on every address (readiness is
        # its chains, firewall_in_place), and metrics are off by default.
        "--health-port=0", "--metrics-port=0", "--v=1",
    ]


def wait_pods_gone(cluster: KubeCluster, timeout: float = 120.0) -> None:
    """Delete every pod (its grace period cut to 1 s) and wait until none is left."""
    kubectl = cluster.kubectl_args()
    subprocess.run([*kubectl, "delete", "pods", "--all", "--all-namespaces", "--grace-period=1", "--wait=false"],
                   capture_output=True, check=False)
    deadline = time.monotonic() + timeout
    while True:
        listing = subprocess.run([*kubectl, "get", "pods", "--all-namespaces", "-o", "name"],
                                 capture_output=True, text=True, check=False)
        if listing.returncode == 0 and not listing.stdout.strip():
            return
        if time.monotonic() > deadline:
            raise KubeStartError(f"pods still there after {timeout:.0f}s: {listing.stdout}")
        time.sleep(0.5)

