"""Names, data and schemas an app sends to hurt its own sidecar, against a real `casque sidecar`.

Each is refused with a 4xx and a code, and the sidecar keeps answering meanwhile: a name
with a trailing newline, data nested past the depth a schema check takes, a schema pattern
that backtracks.
"""

from __future__ import annotations

import base64
import json
import socket
from typing import Any

from casque.dataschema.validation import MAX_DATA_DEPTH
from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec
from casque.store import Store
from tests.fixtures.sidecars import SidecarProcess
from tests.integration.test_sidecar_abuse import (  # noqa: F401 - sidecar is a fixture
    QUEUE,
    SOCKET_GUARD_SECONDS,
    SUBSCRIBER,
    Answer,
    address,
    exchange,
    nested,
    post_json,
    read_answer,
    sidecar,
)

DRAFT = "https://json-schema.org/draft/2020-12/schema"
BINARY = {"ce-specversion": "1.0", "ce-id": "b-1", "ce-source": "/app", "ce-type": "t",
          "Content-Type": "application/json"}


def schema_queue(store: Store, name: str, schema: dict[str, Any]) -> str:
    catalog.apply_queue(store, QueueRef("default", name), QueueSpec.model_validate(
        {"shards": 1, "retention": 3600, "consistency": "ONE", "schema": {"$schema": DRAFT, **schema}}))
    return f"/v1/queues/{name}/messages"


def message_of(answer: Answer) -> str:
    return str(json.loads(answer.body)["error"]["message"])


def test_a_name_with_a_trailing_newline_is_no_name(sidecar: SidecarProcess) -> None:  # noqa: F811
    # %0A reaches the route as "\n"; `re.match` with `$` took "abused\n" for a DNS label.
    for method, path, code in (
        ("POST", f"/v1/queues/{QUEUE}%0A/messages", "queue_not_found"),
        ("GET", f"/v1/queues/{QUEUE}%0A/stats", "queue_not_found"),
        ("GET", f"/v1/queues/{QUEUE}/subscribers/{SUBSCRIBER}%0A/stats", "subscriber_not_found"),
    ):
        answer = exchange(sidecar.url, method, path, b'{"data": 1}' if method == "POST" else b"",
                          {"Content-Type": "application/json"} if method == "POST" else None)
        assert (answer.status, answer.code) == (404, code), (path, answer)
        assert "must be a DNS label" in message_of(answer), (path, answer)


def test_data_nested_past_the_checked_depth_is_refused_with_its_code(
    store: Store, sidecar: SidecarProcess  # noqa: F811
) -> None:
    messages = schema_queue(store, "nested", {"$defs": {"node": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                                              "$ref": "#/$defs/node"})
    url = sidecar.url
    deep = nested(100_000)
    encoded = base64.b64encode(deep).decode()
    refusals: list[tuple[str, Answer, str]] = [
        # Binary mode: the body is the data, parsed first by the schema check.
        ("binary", exchange(url, "POST", messages, deep, BINARY), "data"),
        ("binary, past the depth by one", exchange(url, "POST", messages, nested(MAX_DATA_DEPTH + 1), BINARY), "data"),
        # Structured mode: JSON data sent as data_base64, and data the request's parser takes.
        ("data_base64", post_json(url, messages, json.dumps(
            {"data_base64": encoded, "datacontenttype": "application/json"}).encode()), "data"),
        ("data", post_json(url, messages, b'{"data": ' + nested(MAX_DATA_DEPTH + 20) + b"}"), "data"),
        ("in a batch", post_json(url, f"{messages}/batch", json.dumps({"messages": [
            {"data": []}, {"data_base64": encoded, "datacontenttype": "application/json"}]}).encode()),
         "messages[1].data"),
    ]
    for what, answer, field in refusals:
        assert (answer.status, answer.code) == (400, "data_too_deep"), (what, answer)
        detail = json.loads(answer.body)["error"]["details"][0]
        assert (detail["field"], detail["rule"]) == (field, "maxDepth"), (what, detail)
    assert exchange(url, "POST", messages, nested(MAX_DATA_DEPTH), BINARY).status == 200  # at the depth: taken
    assert sidecar.alive


def test_a_backtracking_pattern_neither_holds_the_sidecar_nor_its_publish(
    store: Store, sidecar: SidecarProcess  # noqa: F811
) -> None:
    # Python's `re` tries 2^35 ways to split the a's before it gives up on the "!".
    messages = schema_queue(store, "patterned", {"type": "string", "pattern": "^(a+)+$"})
    # A first publish loads the queue's publisher, so the next one goes straight to its check.
    assert exchange(sidecar.url, "POST", messages, json.dumps("a" * 35).encode(), BINARY).status == 200
    body = json.dumps("a" * 35 + "!").encode()
    head = f"POST {messages} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in {
        **BINARY, "Host": "127.0.0.1", "Connection": "close", "Content-Length": str(len(body))}.items())
    with socket.create_connection(address(sidecar.url), timeout=SOCKET_GUARD_SECONDS) as publish:
        publish.sendall(head.encode() + b"\r\n" + body)  # sent whole before /readyz is asked
        readiness = sidecar.readiness(timeout=30)
        assert readiness[0] == 200, readiness
        answer = read_answer(publish)
    assert (answer.status, answer.code) == (400, "schema_violation"), answer
    assert json.loads(answer.body)["error"]["details"][0]["rule"] == "pattern"


