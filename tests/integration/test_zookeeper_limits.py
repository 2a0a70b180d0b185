"""What a ZooKeeper server started from casque's configuration (the local stack's, which the
backends' image renders its own from) refuses any client that reaches its port: more
connections from one address than `maxClientCnxns`, and four-letter words beyond `srvr`.

Before, `maxClientCnxns=0` took 150 sessions from one address (a pod could hold the
ensemble's file descriptors), and `stat` listed every connected client's address to anyone.
The server here is one of its own, with a small cap, so that filling it holds back no other
test's clients (they all come from 127.0.0.1).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from casque.devstack.zookeeper import ZooKeeperServer
from tests.fixtures.waiting import reserved_port, wait_for

CAP = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    directory: Path = tmp_path_factory.mktemp("zookeeper-limits")
    started = ZooKeeperServer(directory, client_port=reserved_port(), max_client_connections=CAP)
    started.start()
    try:
        wait_for("the capped ZooKeeper to serve", lambda: started.mode() == "standalone", timeout=90)
        yield started
    finally:
        started.stop()


def session(server: ZooKeeperServer) -> KazooClient:
    client = KazooClient(hosts=server.connect_string, timeout=10)
    client.start(timeout=30)
    return client


def closed_by_the_server(server: ZooKeeperServer) -> bool:
    """Whether a new connection from this address is closed before it says anything (so
    soon, on a loaded machine, that the connect itself meets the closed socket)."""
    try:
        with socket.create_connection((server.address, server.client_port), timeout=30) as sock:
            try:
                return sock.recv(1) == b""
            except TimeoutError:
                return False  # held open: the server waits for the handshake
    except (BrokenPipeError, ConnectionResetError):
        return True


def test_one_address_holds_no_more_connections_than_the_cap(server: ZooKeeperServer) -> None:
    clients = []
    try:
        for _ in range(CAP):
            clients.append(session(server))
        assert all(client.connected for client in clients)
        assert closed_by_the_server(server), f"a connection past {CAP} from one address was accepted"
        # The sessions it holds keep working, and one closed frees its place.
        clients[0].create("/still-served", b"", ephemeral=True)
        clients.pop().stop()
        wait_for("a place freed by a closed session", lambda: not _refused_now(server), timeout=60)
        clients.append(session(server))
    finally:
        for client in clients:
            client.stop()
            client.close()


def _refused_now(server: ZooKeeperServer) -> bool:
    probe = KazooClient(hosts=server.connect_string, timeout=10)
    try:
        probe.start(timeout=5)
        return False
    except Exception:  # kazoo's timeout: the server closed every attempt
        return True
    finally:
        probe.stop()
        probe.close()


def test_only_the_probes_four_letter_word_is_answered(server: ZooKeeperServer) -> None:
    assert "Mode: standalone" in (server.four_letter_word("srvr") or "")
    for word in ("stat", "cons", "dump", "envi", "wchc"):
        answer = server.four_letter_word(word) or ""
        assert "is not executed because it is not in the whitelist" in answer, (word, answer)
        assert "127.0.0.1" not in answer  # no client's address
