"""The partition nemesis itself (tests.fixtures.proxy): what a cut, a blackhole and a slow
link do to real clients, and that a proxied sidecar really reaches its backends only
through its proxies, so that cutting them cuts it off.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cassandra.cluster import Cluster, NoHostAvailable
from cassandra.policies import ConstantReconnectionPolicy
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import ConnectionLoss
from kazoo.handlers.threading import KazooTimeoutError

from casque.backends.cql import SOCKET_OPTIONS
from tests.fixtures.proxy import Proxy
from tests.fixtures.sidecars import SidecarProcess, StartSidecar
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import wait_for


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP echo server on a thread of its own; its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # reset by a cut proxy
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
def proxy_to(request: pytest.FixtureRequest) -> Iterator[type[Proxy]]:
    made: list[Proxy] = []

    def make(host: str, port: int) -> Proxy:
        proxy = Proxy(host, port)
        made.append(proxy)
        return proxy

    yield make  # type: ignore[misc]
    for proxy in made:
        proxy.close()


def _reset(sock: socket.socket) -> bool:
    """Whether the peer reset (or closed) the connection."""
    try:
        sock.sendall(b"x")
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_a_blackhole_holds_both_ways_and_heal_delivers_what_waited(echo: int, proxy_to: type[Proxy]) -> None:
    proxy = proxy_to("127.0.0.1", echo)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
        proxy.blackhole()
        sock.sendall(b"held")
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):  # absence: nothing comes back while blackholed
            sock.recv(4)
        # A new connection is taken and never answered either.
        with socket.create_connection(("127.0.0.1", proxy.port)) as late:
            late.sendall(b"late")
            late.settimeout(1.0)
            with pytest.raises(TimeoutError):
                late.recv(4)
            proxy.heal()
            late.settimeout(30)
            assert late.recv(4) == b"late"
        sock.settimeout(30)
        assert sock.recv(4) == b"held"


def test_a_cut_resets_open_connections_and_new_ones_until_healed(echo: int, proxy_to: type[Proxy]) -> None:
    proxy = proxy_to("127.0.0.1", echo)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(30)
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
        proxy.cut()
        assert _reset(sock)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(30)
        assert _reset(sock)
    proxy.heal()
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(30)
        sock.sendall(b"back")
        assert sock.recv(4) == b"back"


def test_a_slow_link_delays_each_way_in_order(echo: int, proxy_to: type[Proxy]) -> None:
    proxy = proxy_to("127.0.0.1", echo)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(30)
        proxy.slow(0.3)
        sent = time.monotonic()
        sock.sendall(b"a")
        sock.sendall(b"b")
        got = b""
        while len(got) < 2:
            got += sock.recv(2)
        # A lower bound only: the delay is added once each way.
        assert got == b"ab" and time.monotonic() - sent >= 0.6


def test_a_zookeeper_client_through_a_cut_proxy_loses_its_connection_and_recovers(
    backends: Backends, proxy_to: type[Proxy]
) -> None:
    host, _, port = backends.zookeeper_hosts.split(",")[0].rpartition(":")
    proxy = proxy_to(host, int(port))
    client = KazooClient(hosts=proxy.address, timeout=20)
    client.start(timeout=15)
    try:
        assert client.exists_async("/").get(timeout=30) is not None
        # A request on the wire when the cut comes fails with ConnectionLoss (one made while
        # cut off waits in kazoo's queue for the reconnection).
        proxy.blackhole()
        pending = client.exists_async("/")
        wait_for("the request to be sent", lambda: client._pending)
        proxy.cut()
        with pytest.raises(ConnectionLoss):
            pending.get(timeout=30)
        wait_for("the client to notice the cut", lambda: client.state == KazooState.SUSPENDED)
        waiting = client.exists_async("/")
        with pytest.raises(KazooTimeoutError):  # absence: no answer while cut
            waiting.get(timeout=1)
        assert client.state == KazooState.SUSPENDED, "it reconnected through a cut proxy"
        proxy.heal()
        assert waiting.get(timeout=30) is not None
        wait_for("the client to reconnect through the healed proxy", lambda: client.connected)
        assert client.exists_async("/").get(timeout=30) is not None
    finally:
        client.stop()
        client.close()


def test_a_cassandra_session_through_a_cut_proxy_fails_and_recovers(
    backends: Backends, proxy_to: type[Proxy]
) -> None:
    proxy = proxy_to(backends.contact_points[0], backends.cql_port)
    cluster = Cluster(["127.0.0.1"], port=proxy.port, sockopts=SOCKET_OPTIONS,
                      reconnection_policy=ConstantReconnectionPolicy(0.2))
    session = cluster.connect()
    try:
        # The node it learns of from system.local is the proxy's address, not the real one.
        assert {h.endpoint.port for h in cluster.metadata.all_hosts()} == {proxy.port}
        session.execute("SELECT release_version FROM system.local")
        proxy.cut()
        with pytest.raises(NoHostAvailable):
            session.execute("SELECT release_version FROM system.local")

        def answers() -> bool:
            try:
                session.execute("SELECT release_version FROM system.local")
            except NoHostAvailable:
                return False
            return True

        proxy.heal()
        wait_for("the session to reconnect through the healed proxy", answers)
    finally:
        cluster.shutdown()


def test_a_proxied_sidecar_reaches_its_backends_only_through_its_proxies(
    backends: Backends, start_sidecar: StartSidecar
) -> None:
    sidecar = start_sidecar(proxied=True)
    assert sidecar.proxies is not None
    ports = _peer_ports(sidecar)
    proxied = {proxy.port for proxy in sidecar.proxies}
    real = {backends.cql_port} | {int(h.rpartition(":")[2]) for h in backends.zookeeper_hosts.split(",")}
    assert ports & proxied == proxied, ports
    assert not ports & real, f"connected to the real servers: {ports & real}"
    assert all(proxy.accepted for proxy in sidecar.proxies)
    for proxy in sidecar.proxies:
        proxy.cut()
        wait_for(f"/readyz to fail with {proxy.name} cut", lambda: sidecar.readiness()[0] == 503)
        assert not _peer_ports(sidecar) & real, "it went around the cut proxy"
        proxy.heal()
        sidecar.wait_ready()


def _peer_ports(sidecar: SidecarProcess) -> set[int]:
    """The remote ports of the process's established TCP connections (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{sidecar.pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "01":  # ESTABLISHED
                ports.add(int(fields[2].rpartition(":")[2], 16))
    return ports
