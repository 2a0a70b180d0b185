"""The local stack's datacenter layouts, without starting a server: which node is in which
datacenter, what each node's snitch configuration says, and what `stack.json` keeps; and
the wait for a storage port a stopped node left in TIME_WAIT."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from casque.devstack.stack import Stack, _wait_bindable, datacenter_names
from casque.errors import StackError


@pytest.mark.parametrize(("nodes", "datacenters", "names"), [
    (1, 1, [None]),
    (3, 1, [None, None, None]),
    (2, 2, ["dc1", "dc2"]),
    (3, 2, ["dc1", "dc1", "dc2"]),
    (4, 2, ["dc1", "dc1", "dc2", "dc2"]),
])
def test_nodes_split_into_contiguous_datacenters_the_first_the_larger(
        nodes: int, datacenters: int, names: list[str | None]) -> None:
    assert datacenter_names(nodes, datacenters) == names


@pytest.mark.parametrize(("nodes", "datacenters"), [(1, 2), (5, 1), (0, 1), (2, 3)])
def test_layouts_the_stack_cannot_run_are_refused(nodes: int, datacenters: int) -> None:
    with pytest.raises(StackError):
        datacenter_names(nodes, datacenters)


def test_two_datacenters_use_the_gossiping_snitch_with_a_rackdc_file_per_node(tmp_path: Path) -> None:
    stack = Stack(tmp_path, nodes=2, datacenters=2)
    first, second = stack.cassandra_nodes()
    assert (first.address, first.datacenter, second.address, second.datacenter) == (
        "127.0.0.1", "dc1", "127.0.0.2", "dc2")
    assert second.jmx_port == stack.ports.jmx + 100
    second.write_config()
    assert "endpoint_snitch: GossipingPropertyFileSnitch\n" in (second.directory / "cassandra.yaml").read_text()
    assert (second.directory / "cassandra-rackdc.properties").read_text().splitlines() == ["dc=dc2", "rack=rack1"]
    flag = f"-Dcassandra-rackdc.properties=file://{second.directory.resolve()}/cassandra-rackdc.properties"
    assert flag in second.java_command()
    assert [s.datacenter for s in stack.status() if s.name.startswith("cassandra")] == ["dc1", "dc2"]


def test_one_datacenter_keeps_the_simple_snitch_and_no_rackdc_file(tmp_path: Path) -> None:
    (node,) = Stack(tmp_path).cassandra_nodes()
    node.write_config()
    assert "endpoint_snitch: SimpleSnitch\n" in (node.directory / "cassandra.yaml").read_text()
    assert not (node.directory / "cassandra-rackdc.properties").exists()
    assert not any("rackdc" in arg for arg in node.java_command())
    assert [s.datacenter for s in Stack(tmp_path).status() if s.name.startswith("cassandra")] == ["datacenter1"]


def test_the_datacenters_survive_a_reload_and_old_state_files_mean_one(tmp_path: Path) -> None:
    two = Stack(tmp_path / "two", nodes=4, datacenters=2)
    two._save()
    assert Stack.load(tmp_path / "two") == two
    one = Stack(tmp_path / "one", nodes=3)
    one._save()
    assert "datacenters" not in json.loads(one.state_file.read_text())  # a one-DC file as before
    loaded = Stack.load(tmp_path / "one")
    assert loaded == one and loaded is not None and loaded.datacenters == 1


def test_a_node_waits_for_its_storage_port_to_be_bindable_and_says_why_it_gave_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        with pytest.raises(StackError, match=f"127.0.0.1:{port} cannot be bound"):
            _wait_bindable("127.0.0.1", port, "Cassandra storage", timeout=0)
    _wait_bindable("127.0.0.1", port, "Cassandra storage", timeout=0)  # released: returns at once
