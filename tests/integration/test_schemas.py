"""Queue schemas through a real sidecar on the session's Cassandra and ZooKeeper: valid and
invalid publishes in every content mode, the app client's typed error, and messages that keep
the schema version they were checked against across a schema change."""

from __future__ import annotations

import json
from typing import Any

import pytest
from casque_client import AsyncClient, SchemaViolation
from cloudevents.v1.conversion import to_binary, to_json, to_structured
from cloudevents.v1.http import CloudEvent

from casque.engine import catalog
from casque.errors import IncompatibleSchema
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.integration.test_sidecar import (  # noqa: F401 - make_sidecar is a fixture
    BASE,
    QUEUE,
    SUBSCRIBER,
    Client,
    MakeSidecar,
    make_sidecar,
    receive_all,
    until,
)

REF = QueueRef("default", QUEUE)
ORDER: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["orderId"],
    "additionalProperties": False,
    "properties": {
        "orderId": {"type": "string"},
        "currency": {"enum": ["EUR", "USD"]},
        "lines": {"type": "array", "items": {"type": "object", "properties": {"quantity": {"minimum": 1}}}},
    },
}
# Backward compatible: the enum widens.
WIDER = {**ORDER, "properties": {**ORDER["properties"], "currency": {"enum": ["EUR", "USD", "GBP"]}}}
# Not: a new required property.
NARROWER = {**WIDER, "required": ["orderId", "currency"]}
GOOD = {"orderId": "o-1", "currency": "EUR"}
BAD = {"orderId": "o-2", "lines": [{"quantity": 1}, {"quantity": 0}]}
MESSAGES = f"{BASE}/messages"


def apply(store: Store, schema: dict[str, Any] | None, **spec: Any) -> None:
    catalog.apply_queue(store, REF, QueueSpec.model_validate(
        {"shards": 2, "retention": 3600, "consistency": "ONE", "schema": schema, **spec}))


def create_queue(store: Store, schema: dict[str, Any]) -> None:
    apply(store, schema)
    catalog.apply_subscriber(store, REF, SUBSCRIBER, SubscriberSpec(queue=QUEUE, start_position="earliest"))


def event(data: Any, n: int) -> CloudEvent:
    return CloudEvent({"type": "com.example.order", "source": "/shop", "id": f"e{n}",
                       "datacontenttype": "application/json"}, data)


async def refusal(response: Any) -> dict[str, Any]:
    body = await response.json()
    assert response.status == 400, body
    error: dict[str, Any] = body["error"]
    assert error["code"] == "schema_violation"
    return error


def refused_count(metrics: str, rule: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("casque_sidecar_schema_refused_publishes_total{") and f'rule="{rule}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_every_content_mode_checks_the_schema_and_stamps_the_version(
    store: Store, make_sidecar: MakeSidecar  # noqa: F811
) -> None:
    create_queue(store, ORDER)
    client: Client = await make_sidecar()

    # Structured mode, plain JSON and application/cloudevents+json, and JSON sent as data_base64.
    assert (await client.post(MESSAGES, json={"data": GOOD})).status == 200
    headers, body = to_structured(event(GOOD, 1))
    assert (await client.post(MESSAGES, data=body, headers=headers)).status == 200
    error = await refusal(await client.post(MESSAGES, json={"data": BAD}))
    assert error["details"] == [{"field": "data", "problem": error["message"], "path": "/lines/1/quantity",
                                 "rule": "minimum", "schemaVersion": 1}]
    assert error["message"].startswith("data at /lines/1/quantity breaks 'minimum'")
    headers, body = to_structured(event(BAD, 2))
    assert (await refusal(await client.post(MESSAGES, data=body, headers=headers)))["details"][0]["rule"] == "minimum"
    encoded = {"data_base64": "eyJjdXJyZW5jeSI6ICJFVVIifQ==", "datacontenttype": "application/json"}  # no orderId
    assert (await refusal(await client.post(MESSAGES, json=encoded)))["details"][0]["rule"] == "required"

    # Binary mode: the body is the data.
    headers, body = to_binary(event(GOOD, 3))
    assert (await client.post(MESSAGES, data=body, headers=headers)).status == 200
    headers, body = to_binary(event({"orderId": 7}, 4))
    error = await refusal(await client.post(MESSAGES, data=body, headers=headers))
    assert (error["details"][0]["path"], error["details"][0]["rule"]) == ("/orderId", "type")
    text = {"ce-specversion": "1.0", "ce-id": "t", "ce-source": "/shop", "ce-type": "x", "Content-Type": "text/plain"}
    assert (await refusal(await client.post(MESSAGES, data=b"hello", headers=text)))["details"][0]["rule"] == \
        "contentType"

    # Batches, both forms: all or none, the refused message named by its index.
    batch = b"[" + b",".join(to_json(event(data, n)) for n, data in ((5, GOOD), (6, {"orderId": "o-6"}))) + b"]"
    cloudevents_batch = {"Content-Type": "application/cloudevents-batch+json"}
    assert (await client.post(MESSAGES, data=batch, headers=cloudevents_batch)).status == 200
    batch = b"[" + b",".join(to_json(event(data, n)) for n, data in ((7, GOOD), (8, BAD))) + b"]"
    error = await refusal(await client.post(MESSAGES, data=batch, headers=cloudevents_batch))
    assert error["details"][0]["field"] == "messages[1].data" and error["message"].startswith("messages[1]: ")
    assert (await client.post(f"{MESSAGES}/batch", json={"messages": [{"data": GOOD}]})).status == 200
    error = await refusal(await client.post(f"{MESSAGES}/batch", json={"messages": [{"data": GOOD}, {"data": {}}]}))
    assert (error["details"][0]["field"], error["details"][0]["rule"]) == ("messages[1].data", "required")

    # Six accepted, each carrying the version it was checked against; nothing of a refused batch.
    received = await receive_all(client, 6)
    assert len(received) == 6
    assert {m["schemaversion"] for m in received} == {1}
    assert all("casque-schema-version" not in m["attributes"] for m in received)
    assert await receive_all(client, 1, limit_s=1) == []

    metrics = await (await client.get("/metrics")).text()
    assert refused_count(metrics, "minimum") == 3
    assert refused_count(metrics, "required") == 2
    assert refused_count(metrics, "type") == 1 and refused_count(metrics, "contentType") == 1


async def test_the_app_client_raises_a_typed_schema_violation(store: Store, make_sidecar: MakeSidecar) -> None:  # noqa: F811
    create_queue(store, ORDER)
    client: Client = await make_sidecar()
    async with AsyncClient(url=str(client.make_url("")).rstrip("/"), queue=QUEUE) as app:
        await app.publish(GOOD)
        with pytest.raises(SchemaViolation) as single:
            await app.publish(BAD)
        assert (single.value.path, single.value.rule, single.value.schema_version, single.value.index) == (
            "/lines/1/quantity", "minimum", 1, None)
        assert single.value.status == 400 and single.value.code == "schema_violation"
        with pytest.raises(SchemaViolation) as batch:
            await app.publish_batch([{"data": GOOD}, {"data": GOOD}, {"data": {"orderId": "o", "currency": "JPY"}}])
        assert (batch.value.path, batch.value.rule, batch.value.index) == ("/currency", "enum", 2)
        (message,) = await app.receive(max=10, wait=5, subscriber=SUBSCRIBER)
        assert message.schema_version == 1 and json.loads(message.payload) == GOOD


async def test_messages_keep_the_version_they_were_checked_against_across_a_change(
    store: Store, make_sidecar: MakeSidecar  # noqa: F811
) -> None:
    create_queue(store, ORDER)
    client: Client = await make_sidecar()
    for n in range(3):
        assert (await client.post(MESSAGES, json={"data": {"orderId": f"v1-{n}"}})).status == 200

    # A compatible change (the enum widens) is version 2. The sidecar takes it up when its
    # watch on the queue's znode fires: until then GBP is refused under version 1.
    apply(store, WIDER)
    assert catalog.read_queue(store, REF).schema_version == 2

    async def gbp_accepted() -> bool:
        response = await client.post(MESSAGES, json={"data": {"orderId": "v2", "currency": "GBP"}})
        if response.status == 400:
            assert (await refusal(response))["details"][0]["schemaVersion"] == 1
        return response.status == 200

    await until(gbp_accepted)

    # An incompatible change is refused and version 2 stays in force.
    with pytest.raises(IncompatibleSchema, match="required adds currency"):
        apply(store, NARROWER)
    state = catalog.read_queue(store, REF)
    assert state.schema_version == 2 and state.spec.data_schema == WIDER
    assert (await client.post(MESSAGES, json={"data": {"orderId": "v2-b"}})).status == 200

    received = await receive_all(client, 5)
    versions = {m["data"]["orderId"]: m["schemaversion"] for m in received}
    assert versions == {"v1-0": 1, "v1-1": 1, "v1-2": 1, "v2": 2, "v2-b": 2}

    # Forced through with schemaCompatibility none: version 3, and the old messages still say 1 and 2.
    apply(store, NARROWER, schemaCompatibility="none")
    assert catalog.read_queue(store, REF).schema_version == 3
