"""What a test node changes on its host, and putting it back (casque.devstack.node).

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

A node killed before it could stop (kill -9 of its test session) leaves its pods' network
namespaces and containerd shims: found here, and cleared before the next node starts.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from casque.devstack.kube import KubeStartError

__all__ = ["BRIDGE", "CGROUP_ROOT", "POD_SUBNET", "HostBaseline", "cgroup_hierarchies", "kube_router_ipsets",
           "mounts_under", "pod_namespaces", "remove_cgroups", "rules_into", "shims_of_dead_nodes", "take_host_lock",
           "unmount_under", "weigh_node_cgroup"]

BRIDGE = "casque0"
POD_SUBNET = "10.244.0.0/24"
# Every cgroup the kubelet makes is under this one, in each hierarchy.
CGROUP_ROOT = "casque-node"
CGROUP_MOUNT = Path("/sys/fs/cgroup")
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
# Fixed paths outside the node's directory that the kubelet or containerd create.
FIXED_DIRECTORIES = (
    Path("/var/lib/kubelet"),            # the device manager's socket directory
    Path("/var/log/containers"),         # the kubelet's links to container logs
    Path("/run/containerd"),             # containerd's shims' sockets
    Path("/var/run/netns"),              # pods' network namespaces, made by containerd
    Path("/usr/libexec/kubernetes"),
)
IPTABLES_TABLES = ("filter", "nat", "mangle")


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


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or under `directory`, deepest first."""
    prefix = str(directory)
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=len, reverse=True)


def unmount_under(directory: Path) -> None:
    for point in mounts_under(directory):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


def cgroup_hierarchies() -> list[Path]:
    if not CGROUP_MOUNT.is_dir():
        return []
    return [p for p in CGROUP_MOUNT.iterdir() if p.is_dir() and (p / "cgroup.procs").exists()]


def weigh_node_cgroup(root: str, cores: int) -> None:
    """Give the node's cgroup `root` the CPU weight of `cores` cores, as the kubelet weighs its
    pods' cgroup by the node's capacity. The node's pods share that one cgroup, which the
    host's scheduler weighs against each busy thread of the host's own (cgroup v1 puts the
    root's threads beside its child groups): left at one thread's weight, the pods of a node
    on a busy host started their JVMs at a few percent of a core."""
    shares = 1024 * cores
    for hierarchy in cgroup_hierarchies():
        node = hierarchy / root
        if (node / "cpu.shares").exists():
            (node / "cpu.shares").write_text(str(shares))
        elif (node / "cpu.weight").exists():  # cgroup v2: the kubelet's conversion of shares
            (node / "cpu.weight").write_text(str(1 + (shares - 2) * 9999 // 262142))


def remove_cgroups(root: Path) -> None:
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
    unmount_under(fixed)
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
        for hierarchy in cgroup_hierarchies():
            remove_cgroups(hierarchy / CGROUP_ROOT)
        for fixed in self.absent_directories:
            _remove_fixed_directory(fixed, directory)
        left = [str(fixed) for fixed in self.absent_directories if fixed.exists()]
        if not self.bridge_existed and Path(f"/sys/class/net/{BRIDGE}").exists():
            left.append(f"the bridge {BRIDGE}")
        left += [f"cgroup {h / CGROUP_ROOT}" for h in cgroup_hierarchies() if (h / CGROUP_ROOT).exists()]
        for command, before in self.iptables.items():
            after = _iptables_chains(command)
            left += [f"{command} -t {t} chain {c}" for t in after for c in sorted(after[t] - before.get(t, set()))]
        left += [f"ipset {name}" for name in sorted(_ipsets() - self.ipsets)]
        return left


def pod_namespaces() -> list[str]:
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


def shims_of_dead_nodes() -> list[int]:
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


def take_host_lock(timeout: float) -> IO[bytes]:
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
