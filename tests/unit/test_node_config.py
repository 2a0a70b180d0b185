"""The test nodes' configuration and host bookkeeping (casque.devstack.node, node_host and
node_namespaces), without starting anything; and the stack on the host's address that their
pods reach."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from casque.devstack.kube import SERVICE_CLUSTER_IP_RANGE
from casque.devstack.node import (
    CLUSTER_DOMAIN,
    FIRST_LAYOUT,
    SECOND_LAYOUT,
    SECOND_NETWORK,
    cni_config,
    containerd_config,
    corefile,
    firewall_command,
    kubelet_config,
)
from casque.devstack import node_host
from casque.devstack.node_host import BRIDGE, CGROUP_ROOT, kube_router_ipsets, rules_into, weigh_node_cgroup
from casque.devstack.node_namespaces import NodeNetwork
from casque.devstack.stack import Stack
from casque.errors import StackError


def test_containerd_keeps_to_its_own_directory_and_restricts_oom_scores(tmp_path: Path) -> None:
    config = tomllib.loads(containerd_config(tmp_path, "localhost/pause:1"))
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["sandbox_image"] == "localhost/pause:1"
    assert cri["cni"]["conf_dir"] == str(tmp_path / "cni")
    runc = cri["containerd"]["runtimes"]["runc"]["options"]
    assert runc["SystemdCgroup"] is False
    for path in (config["root"], config["state"], config["grpc"]["address"], runc["Root"]):
        assert Path(path).is_relative_to(tmp_path)


def test_a_nodes_cgroup_weighs_as_many_cores_as_the_node_has_in_either_cgroup_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A cgroup v1 mount (a cpu hierarchy, and one without CPU files) and a v2 one.
    for hierarchy, files in (("v1/cpu", ("cpu.shares",)), ("v1/memory", ()), ("v2", ("cpu.weight",))):
        (tmp_path / hierarchy).mkdir(parents=True)
        (tmp_path / hierarchy / "cgroup.procs").touch()
        (tmp_path / hierarchy / CGROUP_ROOT).mkdir()
        for name in files:
            (tmp_path / hierarchy / CGROUP_ROOT / name).write_text("100\n")
    monkeypatch.setattr(node_host, "CGROUP_MOUNT", tmp_path / "v1")
    weigh_node_cgroup(CGROUP_ROOT, 2)
    assert (tmp_path / "v1" / "cpu" / CGROUP_ROOT / "cpu.shares").read_text() == "2048"
    assert not list((tmp_path / "v1" / "memory" / CGROUP_ROOT).iterdir())
    monkeypatch.setattr(node_host, "CGROUP_MOUNT", tmp_path)
    weigh_node_cgroup(CGROUP_ROOT, 2)
    assert (tmp_path / "v2" / CGROUP_ROOT / "cpu.weight").read_text() == "79"  # what the kubelet gives 2048 shares


def test_the_pods_network_adds_no_nat_rules(tmp_path: Path) -> None:
    (bridge,) = json.loads(cni_config(tmp_path))["plugins"]
    assert (bridge["type"], bridge["bridge"], bridge["ipMasq"]) == ("bridge", BRIDGE, False)
    assert bridge["ipam"]["dataDir"] == str(tmp_path / "cni-ipam")


def test_the_kubelet_makes_no_iptables_chains_and_keeps_its_cgroups_under_one_root(tmp_path: Path) -> None:
    config = json.loads(kubelet_config(tmp_path, "192.0.2.2", 10250, tmp_path / "ca.crt"))
    assert config["makeIPTablesUtilChains"] is False
    assert config["cgroupRoot"] == f"/{CGROUP_ROOT}"
    assert config["oomScoreAdj"] == 0
    assert config["authentication"]["anonymous"]["enabled"] is False


def test_the_pods_resolve_through_coredns_on_the_nodes_address(tmp_path: Path) -> None:
    config = json.loads(kubelet_config(tmp_path, "192.0.2.2", 10250, tmp_path / "ca.crt"))
    assert (config["clusterDNS"], config["clusterDomain"]) == (["192.0.2.2"], "cluster.local")
    lines = [line.split() for line in corefile("192.0.2.2", tmp_path / "kubeconfig", 18181).splitlines()]
    assert ["bind", "192.0.2.2"] in lines
    assert ["ready", "127.0.0.1:18181"] in lines
    assert ["kubernetes", CLUSTER_DOMAIN, "in-addr.arpa", "ip6.arpa", "{"] in lines
    assert ["kubeconfig", str(tmp_path / "kubeconfig")] in lines
    # Names outside the cluster go to the host's resolver, not to a public one.
    assert ["forward", ".", "/etc/resolv.conf"] in lines


def test_the_rules_that_jump_to_new_chains_are_found_with_their_quoted_comments() -> None:
    listing = [
        "-P OUTPUT ACCEPT",
        "-N KUBE-SERVICES",
        "-N NETAVARK_FORWARD",
        '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        "-A FORWARD -j NETAVARK_FORWARD",
        "-A KUBE-SERVICES -j RETURN",
    ]
    assert rules_into(listing, {"KUBE-SERVICES"}) == [
        ["OUTPUT", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"]]


def test_the_firewall_runs_alone_and_opens_no_port(tmp_path: Path) -> None:
    argv = firewall_command(tmp_path / "kube-router", tmp_path / "kubeconfig")
    assert {"--run-firewall=true", "--run-router=false", "--run-service-proxy=false"} <= set(argv)
    assert {"--health-port=0", "--metrics-port=0"} <= set(argv)
    assert f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}" in argv


def test_only_kube_routers_ipsets_are_the_nodes_to_remove() -> None:
    names = ["KUBE-SRC-ZUL76ZXAUITE3KSM", "inet6:KUBE-DST-3F57C3Q45CFJ4ZTW", "f2b-sshd", "inet6:allowed"]
    assert kube_router_ipsets(names) == {"KUBE-SRC-ZUL76ZXAUITE3KSM", "inet6:KUBE-DST-3F57C3Q45CFJ4ZTW"}


def test_a_stack_on_the_hosts_address_puts_cassandra_and_zookeeper_there(tmp_path: Path) -> None:
    stack = Stack(tmp_path, address="192.0.2.2")
    (node,) = stack.cassandra_nodes()
    assert (node.address, node.seeds) == ("192.0.2.2", "192.0.2.2")
    assert stack.zookeeper_hosts == f"192.0.2.2:{stack.ports.zookeeper}"
    stack._save()
    assert Stack.load(tmp_path) == stack


def test_a_stack_on_one_address_runs_one_node(tmp_path: Path) -> None:
    with pytest.raises(StackError):
        Stack(tmp_path, nodes=2, address="192.0.2.2").cassandra_nodes()


def test_the_second_node_has_its_own_name_bridge_subnet_and_cgroup_root(tmp_path: Path) -> None:
    assert len({(layout.name, layout.bridge, layout.pod_subnet, layout.cgroup_root)
                for layout in (FIRST_LAYOUT, SECOND_LAYOUT)}) == 2
    assert len({FIRST_LAYOUT.bridge, SECOND_LAYOUT.bridge}) == 2
    assert SECOND_LAYOUT.pod_subnet == SECOND_NETWORK.pod_subnet != FIRST_LAYOUT.pod_subnet
    (bridge,) = json.loads(cni_config(tmp_path, SECOND_LAYOUT))["plugins"]
    assert (bridge["bridge"], bridge["ipam"]["ranges"]) == ("casque1", [[{"subnet": "10.244.1.0/24"}]])
    config = json.loads(kubelet_config(tmp_path, "10.245.0.2", 10250, tmp_path / "ca.crt", SECOND_LAYOUT,
                                       dns_address="192.0.2.2"))
    # Its pods resolve through the first node's CoreDNS; its cgroups are its own.
    assert (config["address"], config["clusterDNS"]) == ("10.245.0.2", ["192.0.2.2"])
    assert config["cgroupRoot"] == f"/{SECOND_LAYOUT.cgroup_root}" != f"/{FIRST_LAYOUT.cgroup_root}"
    assert f"--hostname-override={SECOND_LAYOUT.name}" in firewall_command(tmp_path / "kr", tmp_path / "kc",
                                                                            SECOND_LAYOUT.name)


def test_a_node_network_routes_its_pods_through_its_pair_and_everything_else_back() -> None:
    network = NodeNetwork(namespace="n2", host_link="n2-host", node_link="n2", link_subnet="10.245.0.0/30",
                          pod_subnet="10.244.1.0/24")
    assert (network.host_end, network.node_address) == ("10.245.0.1", "10.245.0.2")
    commands = [" ".join(c) for c in network.setup_commands()]
    assert commands[0] == "ip netns add n2"
    assert "ip link add n2-host type veth peer name n2 netns n2" in commands
    assert "ip -n n2 route add default via 10.245.0.1" in commands
    assert commands[-1] == "ip route add 10.244.1.0/24 via 10.245.0.2 dev n2-host"
    # Interface names the kernel accepts (IFNAMSIZ - 1).
    assert all(len(link) <= 15 for link in (SECOND_NETWORK.host_link, SECOND_NETWORK.node_link))
