"""Bad input, hostile pages, slow clients and absent backends against a real `casque sidecar`.

What must hold through all of it: no answer is a 500, every refusal is a 4xx (or a 503
with Retry-After) with a code, and every message accepted before the abuse is received
after it.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from casque.engine import catalog
from casque.schema import QueueRef
from casque.sidecar.bodies import LARGE_AT_ONCE, OFFLOAD_BYTES, VALUE_BYTES
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from casque_client import Client
from tests.fixtures.forwarder import Forwarder
from tests.fixtures.sidecars import SidecarProcess
from tests.fixtures.stack import Backends
from tests.fixtures.waiting import wait_for

QUEUE = "abused"
SUBSCRIBER = "victim"
REF = QueueRef("default", QUEUE)
PUBLISH = f"/v1/queues/{QUEUE}/messages"
SUB = f"/v1/queues/{QUEUE}/subscribers/{SUBSCRIBER}"
MiB = 1024 * 1024
LIMIT = 4 * MiB  # the sidecar's default request limit
# A socket read that hangs means the sidecar waits for a body it should have refused.
SOCKET_GUARD_SECONDS = 60


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> str | None:
        try:
            return str(json.loads(self.body)["error"]["code"])
        except (ValueError, KeyError, TypeError):
            return None


def create_queue(store: Store) -> None:
    catalog.apply_queue(store, REF, QueueSpec(shards=2, retention_seconds=3600, consistency="ONE",
                                              max_message_bytes=1024 * 1024))
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(
        queue=QUEUE, start_position="earliest", visibility_timeout_seconds=60, max_deliveries=3))


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def read_answer(sock: socket.socket) -> Answer:
    """One HTTP/1.1 answer from the socket (the request asked for Connection: close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Answer(status, headers, body[:length])


def exchange(url: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
             host: str | None = None) -> Answer:
    """A request with exactly these headers (Host included), over a socket of its own."""
    hostname, port = address(url)
    given = {"Host": host if host is not None else f"{hostname}:{port}", "Connection": "close",
             "Content-Length": str(len(body)), **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in given.items()) + "\r\n"
    with socket.create_connection((hostname, port), timeout=SOCKET_GUARD_SECONDS) as sock:
        sock.sendall(head.encode("latin-1") + body)
        return read_answer(sock)


def post_json(url: str, path: str, body: bytes, **headers: str) -> Answer:
    return exchange(url, "POST", path, body, {"Content-Type": "application/json", **headers})


def receive_all(client: Client, expected: set[str]) -> dict[str, Any]:
    """Receive and ack until every expected id came; the messages by id."""
    got: dict[str, Any] = {}

    def more() -> bool:
        messages = client.receive(max=100, wait=1)
        if messages:
            client.ack_batch([m.receipt for m in messages])
        got.update((m.message_id, m) for m in messages)
        return expected <= set(got)

    wait_for(f"{len(expected)} messages", more)
    return got


@pytest.fixture
def sidecar(store: Store, start_sidecar: Callable[..., SidecarProcess]) -> SidecarProcess:
    create_queue(store)
    # A short body timeout, so the trickling client's 408 comes soon; nothing waits on a clock.
    return start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER,
                         env={"CASQUE_SIDECAR_BODY_TIMEOUT_SECONDS": "2", "CASQUE_SIDECAR_HEADER_TIMEOUT_SECONDS": "2"})


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_oversize_bodies_are_refused_before_they_are_read(sidecar: SidecarProcess) -> None:
    hostname, port = address(sidecar.url)
    # Declared too large: the answer comes while the client has sent no byte of the body.
    with socket.create_connection((hostname, port), timeout=SOCKET_GUARD_SECONDS) as sock:
        sock.sendall(f"POST {PUBLISH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {100 * MiB}\r\n\r\n".encode())
        answer = read_answer(sock)
    assert (answer.status, answer.code) == (413, "request_too_large")

    # Chunked, with no length declared: refused once it passes the limit, not read to its end.
    with socket.create_connection((hostname, port), timeout=SOCKET_GUARD_SECONDS) as sock:
        sock.sendall(f"POST {PUBLISH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"x" * MiB
        for _ in range(LIMIT // MiB + 1):
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        answer = read_answer(sock)  # the last chunk never follows
    assert (answer.status, answer.code) == (413, "request_too_large")


def test_abuse_answers_no_500_and_loses_nothing_accepted_before(sidecar: SidecarProcess) -> None:
    url = sidecar.url
    with Client(url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        accepted = {r.message_id for r in client.publish_batch([{"data": {"n": i}} for i in range(50)])}

    deep = nested(100_000)
    refusals: list[tuple[str, Answer, int, str]] = [
        ("deep data", post_json(url, PUBLISH, b'{"data": ' + deep + b"}"), 400, "invalid_json"),
        ("NaN", post_json(url, PUBLISH, b'{"data": {"x": NaN}}'), 400, "invalid_request"),
        ("Infinity", post_json(url, PUBLISH, b'{"data": [Infinity]}'), 400, "invalid_request"),
        ("-Infinity", post_json(url, PUBLISH, b'{"data": -Infinity}'), 400, "invalid_request"),
        ("1e999", post_json(url, PUBLISH, b'{"data": 1e999}'), 400, "invalid_request"),
        ("NaN in a batch", post_json(url, f"{PUBLISH}/batch", b'{"messages": [{"data": 1}, {"data": NaN}]}'),
         400, "invalid_request"),
        # Times whose UTC form lies past 9999 or before year 1 are the last or first instant
        # (casque.instants): beyond the queue's retention, or older than it.
        ("deliverAt past UTC", post_json(url, PUBLISH, b'{"deliverAt": "9999-12-31T23:59:59-23:59"}'),
         409, "invalid_spec"),
        ("seek before UTC", post_json(url, f"{SUB}/seek", b'{"time": "0001-01-01T00:00:00+23:59"}'),
         409, "position_out_of_range"),
        ("text/plain", exchange(url, "POST", PUBLISH, b'{"data": 1}', {"Content-Type": "text/plain"}),
         415, "unsupported_media_type"),
        ("form", exchange(url, "POST", PUBLISH, b"data=1", {"Content-Type": "application/x-www-form-urlencoded"}),
         415, "unsupported_media_type"),
        ("no content type", exchange(url, "POST", PUBLISH, b'{"data": 1}'), 415, "unsupported_media_type"),
        ("foreign Host", post_json(url, PUBLISH, b'{"data": 1}', Host="evil.example:8717"), 421, "foreign_host"),
        ("rebound Host, bodiless", exchange(url, "POST", f"{SUB}/receive", host="evil.example"), 421, "foreign_host"),
        ("page's Origin", post_json(url, PUBLISH, b'{"data": 1}', Origin="https://evil.example"), 403,
         "cross_origin"),
        ("null Origin", exchange(url, "POST", f"{SUB}/receive", headers={"Origin": "null"}), 403, "cross_origin"),
    ]
    for what, answer, status, code in refusals:
        assert (answer.status, answer.code) == (status, code), (what, answer)

    # Payloads stored as their content type says but not renderable as JSON: accepted, and
    # delivered as data_base64 without failing the receive or the messages beside them.
    poison = {
        "deep": nested(50_000),
        "invalid": b'{"not": json',
        "nan": b"[NaN, Infinity]",
    }
    poison_ids = {}
    for name, payload in poison.items():
        body = json.dumps({"data_base64": base64.b64encode(payload).decode(), "datacontenttype": "application/json"})
        answer = post_json(url, PUBLISH, body.encode())
        assert answer.status == 200, (name, answer)
        poison_ids[name] = json.loads(answer.body)["messageId"]
    statuses = [answer.status for _, answer, _, _ in refusals]
    assert 500 not in statuses

    with Client(url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        got = receive_all(client, accepted | set(poison_ids.values()))
    for name, message_id in poison_ids.items():
        assert "data_base64" in got[message_id].event and got[message_id].payload == poison[name], name
    assert all(got[i].delivery_count == 1 for i in accepted)  # none was redelivered beside a poison one
    assert sidecar.alive


def test_a_slow_client_gets_408_and_holds_up_no_one(sidecar: SidecarProcess) -> None:
    hostname, port = address(sidecar.url)
    with socket.create_connection((hostname, port), timeout=SOCKET_GUARD_SECONDS) as slow:
        slow.sendall(f"POST {PUBLISH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n{\"data\": ".encode())
        # While that body trickles, others are served.
        with Client(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
            published = client.publish({"while": "slow"})
            got = receive_all(client, {published.message_id})
        assert published.message_id in got
        answer = read_answer(slow)
    assert (answer.status, answer.code) == (408, "request_timeout")


# --- tokens ----------------------------------------------------------------------------------------
def run_sidecar(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    """`casque sidecar` that must refuse to start: its exit status and output."""
    return subprocess.run([sys.executable, "-m", "casque.cli", "sidecar", "--port", "0", *flags],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env, flags, says", [
    ({"CASQUE_SIDECAR_TOKEN": ""}, (), "token is empty"),
    ({"CASQUE_SIDECAR_TOKEN": "   "}, (), "token is empty"),
    ({}, ("--host", "0.0.0.0"), "needs a token of at least 32 bytes"),
    ({"CASQUE_SIDECAR_TOKEN": "short"}, ("--host", "0.0.0.0"), "needs a token of at least 32 bytes"),
    ({}, ("--token", "a" * 40), "No such option"),  # a flag would show the token in `ps`
])
def test_weak_or_visible_tokens_are_refused_at_start(env: dict[str, str], flags: tuple[str, ...], says: str) -> None:
    result = run_sidecar(env, *flags)
    assert result.returncode != 0
    assert says in result.stdout + result.stderr


def test_a_token_from_a_file_is_required_and_not_in_the_command_line(
    store: Store, start_sidecar: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    create_queue(store)
    token = "t" * 40
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    sidecar = start_sidecar("--token-file", str(token_file))
    assert token.encode() not in Path(f"/proc/{sidecar.pid}/cmdline").read_bytes()
    assert exchange(sidecar.url, "POST", f"{SUB}/receive").status == 401
    empty_bearer = exchange(sidecar.url, "POST", f"{SUB}/receive", headers={"Authorization": "Bearer "})
    assert (empty_bearer.status, empty_bearer.code) == (401, "unauthorized")
    with Client(sidecar.url, queue=QUEUE, token=token) as client:
        assert client.publish({"ok": True}).message_id


# --- backends down at start ------------------------------------------------------------------------
@pytest.fixture
def forwarder() -> Iterator[Callable[[str, int], Forwarder]]:
    made: list[Forwarder] = []

    def make(host: str, port: int) -> Forwarder:
        made.append(Forwarder(host, port))
        return made[-1]

    yield make
    for item in made:
        item.close()


def get(url: str, path: str) -> Answer:
    return exchange(url, "GET", path)


@pytest.mark.parametrize("down", ["zookeeper", "cassandra"])
def test_a_backend_down_at_start_gets_503s_until_it_comes_up(
    down: str, store: Store, backends: Backends, zk_hosts: str,
    start_sidecar: Callable[..., SidecarProcess], forwarder: Callable[[str, int], Forwarder],
) -> None:
    create_queue(store)
    if down == "zookeeper":
        server, _, chroot = zk_hosts.partition("/")
        host, port = server.split(",")[0].rsplit(":", 1)
        gate = forwarder(host, int(port))
        env = {"CASQUE_ZOOKEEPER_HOSTS": f"127.0.0.1:{gate.port}/{chroot}"}
    else:
        gate = forwarder(backends.contact_points[0], backends.cql_port)
        env = {"CASQUE_CASSANDRA_CONTACT_POINTS": "127.0.0.1", "CASQUE_CASSANDRA_PORT": str(gate.port)}
    sidecar = start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER, wait=False, env=env)

    alive = get(sidecar.url, "/healthz")
    assert alive.status == 200 and json.loads(alive.body)["status"] == "starting"
    ready = get(sidecar.url, "/readyz")
    assert ready.status == 503 and "retry-after" in ready.headers
    refused = post_json(sidecar.url, PUBLISH, b'{"data": 1}')
    assert (refused.status, refused.code) == (503, "not_ready") and "retry-after" in refused.headers
    assert sidecar.alive

    gate.open()
    sidecar.wait_ready()
    with Client(sidecar.url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        published = client.publish({"after": down})
        assert published.message_id in receive_all(client, {published.message_id})


def test_probes_answer_any_host_but_the_api_only_the_loopback(sidecar: SidecarProcess) -> None:
    # kubelet and Prometheus may name the pod's IP; the probes carry no message data.
    assert exchange(sidecar.url, "GET", "/healthz", host="10.1.2.3:8717").status == 200
    assert exchange(sidecar.url, "GET", f"/v1/queues/{QUEUE}/stats", host="10.1.2.3:8717").status == 421
    for host in ("localhost:1", "127.0.0.1", "[::1]:8717", "localhost"):
        assert exchange(sidecar.url, "GET", f"/v1/queues/{QUEUE}/stats", host=host).status == 200, host
    with urllib.request.urlopen(f"{sidecar.url}/readyz") as answer:  # the injected probe's own call
        assert answer.status == 200


# --- memory: bodies charged by what they parse into, headers bounded --------------------------------
def request_memory(url: str) -> dict[str, float]:
    """The sidecar's own accounting of request bodies: {"now": bytes, "peak": bytes}."""
    with urllib.request.urlopen(f"{url}/metrics") as answer:
        text = answer.read().decode()
    return {sample.labels["when"]: sample.value
            for family in text_string_to_metric_families(text) if family.name == "casque_sidecar_request_memory_bytes"
            for sample in family.samples}


def concurrently(*calls: Callable[[], Answer]) -> list[Answer]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_bodies_of_tiny_values_are_refused_and_what_parses_is_charged_within_a_bound(sidecar: SidecarProcess) -> None:
    url = sidecar.url
    # 4 MiB of empty objects: 1.4 million Python dicts, over 100 MiB each, were it parsed.
    tiny = b'{"data": [' + b",".join([b"{}"] * ((LIMIT - 64) // 3)) + b"]}"
    assert len(tiny) <= LIMIT
    answers = concurrently(*[lambda: post_json(url, PUBLISH, tiny)] * 2)
    assert [(a.status, a.code) for a in answers] == [(413, "too_many_values")] * 2
    # At the limit of values, padded to the byte limit: parsed, published, and charged.
    values = 131_072 - 16
    heavy = b'{"data": {"items": [' + b",".join([b"{}"] * values) + b'], "pad": "' + b"x" * 300_000 + b'"}}'
    assert OFFLOAD_BYTES < len(heavy) < 1024 * 1024  # a large request, a message the queue takes
    answers = concurrently(*[lambda: post_json(url, PUBLISH, heavy)] * 3)
    assert [a.status for a in answers] == [200] * 3
    memory = request_memory(url)
    per_body = 2 * len(heavy) + values * VALUE_BYTES
    # Each was charged while it was handled, and no more than LARGE_AT_ONCE at a time.
    assert per_body <= memory["peak"] <= LARGE_AT_ONCE * (2 * LIMIT + 131_072 * VALUE_BYTES), memory
    assert memory["now"] == 0
    with Client(url, queue=QUEUE, subscriber=SUBSCRIBER) as client:
        ids = {json.loads(a.body)["messageId"] for a in answers}
        assert set(receive_all(client, ids)) >= ids


def test_a_connection_trickling_its_headers_is_closed(sidecar: SidecarProcess) -> None:
    hostname, port = address(sidecar.url)
    with socket.create_connection((hostname, port), timeout=SOCKET_GUARD_SECONDS) as sock:
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
        sock.settimeout(0.5)
        closed = False
        for _ in range(int(SOCKET_GUARD_SECONDS / 0.5)):  # a header byte every half second, never the end
            try:
                sock.sendall(b"X")
                closed = sock.recv(1024) == b""
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = True
            if closed:
                break
        assert closed, "the sidecar kept a connection whose headers never ended"


def test_headers_too_large_together_are_refused(sidecar: SidecarProcess) -> None:
    many = {f"X-Filler-{i}": "v" * 4000 for i in range(10)}  # 40 KB, each header within the parser's 8 KiB
    answer = exchange(sidecar.url, "GET", f"/v1/queues/{QUEUE}/stats", headers=many)
    assert (answer.status, answer.code) == (431, "headers_too_large")
    assert exchange(sidecar.url, "GET", f"/v1/queues/{QUEUE}/stats",
                    headers=dict(list(many.items())[:6])).status == 200  # 24 KB: taken
