"""The Python client: what it sends again after a timeout, and that it ignores proxies for the loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from casque_client import AsyncClient, Client, RetryPolicy, SidecarUnreachable
from tests.fixtures.waiting import wait_for

RESULTS = {"results": [{"receipt": "r", "status": "acked"}]}


class Sidecar:
    """A stand-in that counts requests per path and holds each one until released (or answers at once)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.release = threading.Event()
        self.hold = True
        sidecar = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                action = self.path.rsplit("/", 1)[-1]
                sidecar.calls[action] = sidecar.calls.get(action, 0) + 1
                if sidecar.hold:
                    sidecar.release.wait(30)  # the client times out first: its answer is lost
                body = json.dumps({"messages": []} if action == "receive" else RESULTS).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def counted(self, expected: dict[str, int]) -> dict[str, int]:
        """The requests counted once as many as `expected` came: the client gives up on a
        request when it times out, and on a loaded machine the handler's thread can count
        the last one only after that."""
        wait_for(f"{sum(expected.values())} requests", lambda: sum(self.calls.values()) >= sum(expected.values()),
                 timeout=30)
        return dict(self.calls)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    running = Sidecar()
    yield running
    running.close()


RETRY = RetryPolicy(attempts=3, backoff=0.01, max_backoff=0.01)


def test_after_a_timeout_receive_nack_and_seek_are_not_sent_again_but_acks_are(sidecar: Sidecar) -> None:
    client = Client(sidecar.url, queue="q", subscriber="s", timeout=0.3, retry=RETRY)
    for call in (lambda: client.receive(wait=0), lambda: client.nack("r"), lambda: client.seek("latest")):
        with pytest.raises(SidecarUnreachable):
            call()
    with pytest.raises(SidecarUnreachable):
        client.ack("r")
    expected = {"receive": 1, "nack": 1, "seek": 1, "ack": 3}
    assert sidecar.counted(expected) == expected


def test_the_async_client_too(sidecar: Sidecar) -> None:
    async def calls() -> None:
        async with AsyncClient(sidecar.url, queue="q", subscriber="s", timeout=0.3, retry=RETRY) as client:
            for call in (client.receive(wait=0), client.nack("r"), client.seek("latest"), client.ack("r")):
                with pytest.raises(SidecarUnreachable):
                    await call

    asyncio.run(calls())
    expected = {"receive": 1, "nack": 1, "seek": 1, "ack": 3}
    assert sidecar.counted(expected) == expected


def test_a_refused_connection_is_retried_for_every_call() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    client = Client(f"http://127.0.0.1:{port}", queue="q", subscriber="s", retry=RETRY)
    with pytest.raises(SidecarUnreachable):
        client.receive()  # three refusals, then the error (nothing was sent, so retrying was safe)


def test_proxies_from_the_environment_are_not_used_for_the_loopback(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    sidecar.hold = False
    # A working proxy that answers like the sidecar: a client that used it would succeed,
    # so only the requests it saw can tell.
    proxy = Sidecar()
    proxy.hold = False
    for name in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, proxy.url)
    for name in ("NO_PROXY", "no_proxy"):  # with these, urllib and aiohttp would skip the proxy themselves
        monkeypatch.delenv(name, raising=False)
    # urlopen keeps the opener (and the proxies) it built on first use: drop it, so the
    # environment above is what a client on that path would see.
    urllib.request.install_opener(None)
    try:
        assert Client(sidecar.url, queue="q", subscriber="s", timeout=5, retry=RETRY).receive() == []

        async def receive() -> list[Any]:
            async with AsyncClient(sidecar.url, queue="q", subscriber="s", timeout=5, retry=RETRY) as client:
                return await client.receive()

        assert asyncio.run(receive()) == []
    finally:
        urllib.request.install_opener(None)
        proxy.close()
    assert proxy.calls == {}
    assert sidecar.calls == {"receive": 2}
