"""The namespaces that let a second node run on the machine beside the first.

Two nodes on one host clash wherever a node uses the host's own state: kube-proxy and
kube-router rewrite the iptables chains of the network namespace they run in (two of them
in one namespace undo each other on every sync), and the kubelet and containerd keep sockets,
log links and pods' network namespaces at fixed paths that ``--root-dir`` does not move.

So the second node's containerd, kubelet, kube-proxy and firewall run in a network namespace
of their own, joined to the host by a veth pair and routed: its pods have a subnet and a
bridge of their own, the host routes that subnet through the pair, and the node routes
everything else back through it (the API server, CoreDNS and the first node's pods are all
reached through the host). And in a mount namespace of their own, a slave of the host's: the
node sees the host's files and mounts (its volumes' host paths, the cgroup hierarchies), its
own mounts (volumes, overlay snapshots, pods' network namespaces) stay in it, and private
directories lie over the fixed paths. One process, the holder, keeps both namespaces; every
process of the node enters them through it (`NodeNamespaces.enter`).

Removing the network namespace removes what was made in it: the node's iptables chains and
ipsets, its bridge, the veth pair and the host's route through it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from casque.devstack.kube import KubeStartError

__all__ = ["HOLDER_MARK", "NodeNamespaces", "NodeNetwork", "clear_dead_namespaces"]

# In the holder's command line, so that a holder whose test session was killed is found.
HOLDER_MARK = "casque-node-namespaces"
# Paths the kubelet or containerd use whatever their configuration says, each given a
# private directory in the node's mount namespace.
PRIVATE_PATHS = (
    Path("/var/lib/kubelet"),        # the device manager's socket
    Path("/var/log/containers"),     # the kubelet's links to container logs, pruned of others'
    Path("/var/log/pods"),
    Path("/run/containerd"),         # the shims' sockets
    Path("/var/run/netns"),          # pods' network namespaces, bind-mounted by containerd
    Path("/usr/libexec/kubernetes"),
)
# Set in the node's network namespace: it routes its pods' packets, and they pass its
# iptables on their bridge (where its firewall is).
NAMESPACE_SYSCTLS = {"net/ipv4/ip_forward": "1", "net/bridge/bridge-nf-call-iptables": "1"}


@dataclass(frozen=True)
class NodeNetwork:
    """A node's network namespace, the veth pair to the host and the node's pod subnet."""

    namespace: str
    # The pair's ends: on the host, and in the namespace. Interface names: 15 bytes at most.
    host_link: str
    node_link: str
    # A /30 for the pair: the host's end is its first address, the node's its second.
    link_subnet: str
    pod_subnet: str

    @property
    def host_end(self) -> str:
        return str(ipaddress.ip_network(self.link_subnet)[1])

    @property
    def node_address(self) -> str:
        """The node's address: its kubelet's, kube-proxy's node ports', the API server's way in."""
        return str(ipaddress.ip_network(self.link_subnet)[2])

    def setup_commands(self) -> list[list[str]]:
        """What makes the namespace, the pair and the routes, in order."""
        prefix = ipaddress.ip_network(self.link_subnet).prefixlen
        inside = ["ip", "-n", self.namespace]
        return [
            ["ip", "netns", "add", self.namespace],
            ["ip", "link", "add", self.host_link, "type", "veth", "peer", "name", self.node_link,
             "netns", self.namespace],
            ["ip", "addr", "add", f"{self.host_end}/{prefix}", "dev", self.host_link],
            ["ip", "link", "set", self.host_link, "up"],
            [*inside, "addr", "add", f"{self.node_address}/{prefix}", "dev", self.node_link],
            [*inside, "link", "set", self.node_link, "up"],
            [*inside, "link", "set", "lo", "up"],
            [*inside, "route", "add", "default", "via", self.host_end],
            ["ip", "route", "add", self.pod_subnet, "via", self.node_address, "dev", self.host_link],
        ]

    def exists(self) -> bool:
        return Path("/var/run/netns", self.namespace).exists()

    def create(self) -> None:
        for command in self.setup_commands():
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise KubeStartError(f"{' '.join(command)} failed: {result.stderr.strip()}")
        for name, value in NAMESPACE_SYSCTLS.items():
            setting = subprocess.run(["ip", "netns", "exec", self.namespace, "sysctl", "-q", "-w",
                                      f"{name.replace('/', '.')}={value}"], capture_output=True, text=True, check=False)
            if setting.returncode != 0:
                raise KubeStartError(f"setting {name} in {self.namespace} failed: {setting.stderr.strip()}")

    def remove(self, timeout: float = 10.0) -> None:
        """The namespace, and with it the pair, the route, and what the node made in it. Its
        name is a mount point, also in the holder's mount namespace while that one lasts (it
        goes a moment after the holder exits): tried again until it goes, within `timeout`."""
        deadline = time.monotonic() + timeout
        while self.exists():
            subprocess.run(["ip", "netns", "delete", self.namespace], capture_output=True, check=False)
            if not self.exists() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # Gone with the namespace's end; left only if the namespace was never made whole.
        subprocess.run(["ip", "link", "delete", self.host_link], capture_output=True, check=False)


@dataclass
class NodeNamespaces:
    """The holder of a node's network and mount namespaces, and how to run a process in them."""

    network: NodeNetwork
    holder: subprocess.Popen[bytes]
    # PRIVATE_PATHS the host lacked, made for the binds: removed at the stop if still empty.
    made: list[Path] = field(default_factory=list)

    @classmethod
    def start(cls, network: NodeNetwork, directory: Path) -> NodeNamespaces:
        """Make the network, start the holder in it with a mount namespace of its own, and lay
        a private directory under `directory` over each of PRIVATE_PATHS."""
        network.create()
        holder = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{network.namespace}", "--", "unshare", "--mount",
             "--propagation", "slave", "--", sys.executable, "-c", "import signal; signal.pause()", HOLDER_MARK,
             str(directory)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        namespaces = cls(network, holder)
        try:
            namespaces._wait_entered()
            for path in PRIVATE_PATHS:
                private = directory / "private" / path.relative_to("/")
                private.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    path.mkdir(parents=True)
                    namespaces.made.append(path)
                namespaces.run(["mount", "--bind", str(private), str(path)])
        except BaseException:
            namespaces.stop()
            raise
        return namespaces

    def _wait_entered(self) -> None:
        """Until the holder runs in its own mount namespace (unshare has exec'd it)."""
        own = os.readlink("/proc/self/ns/mnt")
        for _ in range(200):
            if self.holder.poll() is not None:
                errors = self.holder.stderr.read().decode(errors="replace") if self.holder.stderr else ""
                raise KubeStartError(f"the namespace holder of {self.network.namespace} exited: {errors.strip()}")
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{self.holder.pid}/ns/mnt") != own and HOLDER_MARK.encode() in Path(
                        f"/proc/{self.holder.pid}/cmdline").read_bytes():
                    return
            time.sleep(0.05)
        raise KubeStartError(f"the namespace holder of {self.network.namespace} did not start")

    def enter(self, argv: Sequence[str]) -> list[str]:
        """`argv` run in the node's namespaces (nsenter execs it: its pid is the process's)."""
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--net", f"--wd={os.getcwd()}", "--",
                *argv]

    def run(self, argv: Sequence[str]) -> str:
        result = subprocess.run(self.enter(argv), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KubeStartError(f"{' '.join(argv)} in {self.network.namespace} failed: {result.stderr.strip()}")
        return result.stdout

    def stop(self) -> None:
        """Stop the holder (the mount namespace ends with the last process in it) and remove
        the network. The node's processes are stopped first."""
        if self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait()
        if self.holder.stderr is not None:
            self.holder.stderr.close()
        self.network.remove()
        for path in reversed(self.made):
            with contextlib.suppress(OSError):  # not empty: someone else's now
                path.rmdir()


def clear_dead_namespaces(networks: Sequence[NodeNetwork]) -> None:
    """What a node killed before it could stop left: its holder, its network namespace."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if HOLDER_MARK.encode() in argv[1:] and int(proc.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)
    for network in networks:
        if network.exists():
            network.remove()
