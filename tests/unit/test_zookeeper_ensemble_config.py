"""The local stack's ZooKeeper layouts, without starting a server: one standalone server, or
an ensemble whose members differ by ports and data directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from casque.devstack.stack import Stack, StackPorts
from casque.devstack.zookeeper import ZooKeeperEnsemble, ZooKeeperServer


def test_an_ensemble_of_three_gives_each_member_its_ports_directory_and_id(tmp_path: Path) -> None:
    ensemble = ZooKeeperEnsemble(tmp_path, size=3, client_port=2181, quorum_port=2888, election_port=3888)
    members = ensemble.members()
    assert [m.name for m in members] == ["zookeeper-1", "zookeeper-2", "zookeeper-3"]
    assert [m.directory for m in members] == [tmp_path / f"zookeeper-{n}" for n in (1, 2, 3)]
    assert ensemble.connect_string == "127.0.0.1:2181,127.0.0.1:2182,127.0.0.1:2183"
    assert members[1].ports() == [(2182, "ZooKeeper client"), (2889, "ZooKeeper quorum"),
                                  (3889, "ZooKeeper election")]
    every_port = [port for m in members for port, _ in m.ports()]
    assert len(every_port) == len(set(every_port)) == 9

    members[1].write_config()
    config = (tmp_path / "zookeeper-2" / "zoo.cfg").read_text().splitlines()
    assert (tmp_path / "zookeeper-2" / "data" / "myid").read_text().strip() == "2"
    assert "clientPort=2182" in config
    assert [line for line in config if line.startswith("server.")] == [
        "server.1=127.0.0.1:2888:3888", "server.2=127.0.0.1:2889:3889", "server.3=127.0.0.1:2890:3890"]
    whitelist = next(line for line in config if line.startswith("4lw.commands.whitelist="))
    assert whitelist.partition("=")[2].split(",") == ["srvr"]  # not `stat` or `cons`: they list clients
    assert "maxClientCnxns=500" in config


def test_a_single_server_stays_standalone_in_its_old_directory(tmp_path: Path) -> None:
    (server,) = ZooKeeperEnsemble(tmp_path, size=1, client_port=12181).members()
    assert (server.name, server.directory, server.myid) == ("zookeeper", tmp_path / "zookeeper", None)
    assert server.ports() == [(12181, "ZooKeeper client")]
    server.write_config()
    config = (tmp_path / "zookeeper" / "zoo.cfg").read_text()
    assert "server." not in config and not (tmp_path / "zookeeper" / "data" / "myid").exists()


@pytest.mark.parametrize(("answer", "mode"), [
    ("Zookeeper version: 3.9.4\nLatency min/avg/max: 0/0.0/0\nConnections: 3\nMode: leader\nNode count: 5\n",
     "leader"),
    ("Zookeeper version: 3.9.4\nMode: follower\n", "follower"),
    ("This ZooKeeper instance is not currently serving requests\n", None),
    (None, None),
])
def test_the_mode_is_read_from_srvr(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                    answer: str | None, mode: str | None) -> None:
    server = ZooKeeperServer(tmp_path)
    monkeypatch.setattr(ZooKeeperServer, "four_letter_word", lambda self, word, timeout=2.0: answer)
    assert server.mode() == mode
    assert server.connections() == (3 if mode == "leader" else 0)


def test_a_stack_recorded_before_ensembles_loads_as_one_server(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text(json.dumps({
        "nodes": 1, "heap_mb": 1536, "cluster_name": "casque-dev",
        "ports": {"native": 9042, "storage": 7000, "jmx": 7199, "zookeeper": 2181}}))
    stack = Stack.load(tmp_path)
    assert stack is not None and stack.zookeeper_nodes == 1
    assert stack.ports == StackPorts()
    assert [s.name for s in stack.status()] == ["zookeeper", "cassandra-1"]
    three = Stack(tmp_path, zookeeper_nodes=3)
    assert three.zookeeper_hosts == "127.0.0.1:2181,127.0.0.1:2182,127.0.0.1:2183"
    assert [s.name for s in three.status()][:3] == ["zookeeper-1", "zookeeper-2", "zookeeper-3"]
