"""The OpenAPI 3.1 document of the sidecar, generated from the operations table and the models.

The schemas are the pydantic models' own JSON Schemas (OpenAPI 3.1 uses JSON Schema 2020-12
as pydantic does), so what the document promises is what the sidecar validates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from casque.engine.messages import MESSAGE_ID_PATTERN
from casque.schema import NAME_PATTERN
from casque.sidecar.models.base import ErrorResponse
from casque.sidecar.models.receiving import Message
from casque.sidecar.routes import Operation

REF = "#/components/schemas/{model}"
_REASONS = {
    400: "Bad input: invalid JSON, a missing or unknown field, or one this document forbids",
    401: "Missing or wrong bearer token",
    403: "Outside the pod's publish or subscribe scope (out_of_scope)",
    404: "No such queue or subscriber, or a subscriber this sidecar does not consume for",
    409: "A conflict with the current state: a stale receipt (the delivery expired, was settled, or the message "
         "was handed out again), a lost lease, or a request the queue cannot take as it is now (a priority beyond "
         "its levels, a delay beyond its retention, a seek outside the log)",
    413: "A message larger than the queue allows, or a request body over the sidecar's limit",
    503: "A backend did not answer, or the sidecar is starting or shutting down: retry after Retry-After",
}


def _name_parameter(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": {"type": "string", "pattern": NAME_PATTERN.pattern, "maxLength": 63},
    }


# Links between operations (OpenAPI links): where a later call takes its values from an
# earlier one's answer. A publish's body may carry an `id` of the client's own (its
# idempotency key); the message is traced by the `messageId` the publish answered with.
# The links to ack, nack and extend name no requestBody (a receipt): openapi-generator's
# validator refuses a link whose requestBody is not a string, and a body is an object.
_SAME_SUBSCRIBER = {"queue": "$request.path.queue", "subscriber": "$request.path.subscriber"}


def _settling(operation_id: str, what: str) -> dict[str, Any]:
    """A link from a receive to a call that settles a message it answered with."""
    return {"operationId": operation_id, "parameters": _SAME_SUBSCRIBER,
            "description": f"{what} The body names the message's `receipt` (`messages[].receipt`)."}


def _receiving(description: str) -> dict[str, Any]:
    return {"operationId": "receive", "parameters": {"queue": "$request.path.queue"}, "description": description}


LINKS: dict[str, dict[str, Any]] = {
    "publish": {
        "messageHistory": {
            "operationId": "messageHistory",
            "parameters": {"queue": "$request.path.queue", "messageId": "$response.body#/messageId"},
            "description": "The published message's history, by the id the publish answered with.",
        },
        "receive": _receiving("Receive it through a subscriber of the queue."),
    },
    "publishBatch": {
        "messageHistory": {
            "operationId": "messageHistory",
            "parameters": {"queue": "$request.path.queue", "messageId": "$response.body#/results/0/messageId"},
            "description": "The first published message's history.",
        },
        "receive": _receiving("Receive them through a subscriber of the queue."),
    },
    "receive": {
        "messageHistory": {
            "operationId": "messageHistory",
            "parameters": {"queue": "$request.path.queue", "messageId": "$response.body#/messages/0/messageid"},
            "description": "The first message received's history.",
        },
        "ack": _settling("ack", "Acknowledge a message received: it is done."),
        "nack": _settling("nack", "Give a message received back, to be delivered again."),
        "extendVisibility": _settling("extendVisibility", "Keep a message received invisible for longer."),
    },
}


def build(operations: Iterable[Operation], version: str, bearer_token: bool) -> dict[str, Any]:
    operations = list(operations)
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ErrorResponse, "serialization"), (Message, "serialization")]
    for operation in operations:
        if operation.request is not None:
            models.append((operation.request, "validation"))
        models.append((operation.response, "serialization"))
        if operation.error_response is not ErrorResponse:
            models.append((operation.error_response, "serialization"))
    refs, definitions = models_json_schema(models, ref_template=REF)

    paths: dict[str, dict[str, Any]] = {}
    for operation in operations:
        parameters = [_name_parameter("queue", "The queue's name (in the sidecar's namespace).")]
        if "{subscriber}" in operation.path:
            parameters.append(_name_parameter("subscriber", "The subscriber's name."))
        if "{messageId}" in operation.path:
            parameters.append({"name": "messageId", "in": "path", "required": True,
                               "description": "The id the publish answered with: a version 7 UUID (ids made before "
                               "they carried their time are refused with `untraceable_id`).",
                               "schema": {"type": "string", "pattern": MESSAGE_ID_PATTERN}})
        error_ref = refs[(operation.error_response, "serialization")]
        spec: dict[str, Any] = {
            "operationId": operation.operation_id,
            "summary": operation.summary,
            "parameters": parameters,
            "responses": {
                "200": {
                    "description": "Done",
                    "content": {"application/json": {"schema": refs[(operation.response, "serialization")]}},
                },
                **{
                    str(status): {
                        "description": _REASONS[status],
                        "content": {"application/json": {"schema": error_ref}},
                    }
                    for status in sorted({*operation.errors, *((401,) if bearer_token else ())})
                },
                "default": {
                    "description": "The sidecar's own fault",
                    "content": {"application/json": {"schema": error_ref}},
                },
            },
        }
        if operation.operation_id in LINKS:
            spec["responses"]["200"]["links"] = LINKS[operation.operation_id]
        if operation.request is not None:
            spec["requestBody"] = {
                "required": not operation.body_optional,
                "content": {"application/json": {"schema": refs[(operation.request, "validation")]}},
            }
        paths.setdefault(operation.path, {})[operation.method.lower()] = spec

    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "casque sidecar",
            "version": version,
            "description": (
                "The localhost queue API of casque. Messages are CloudEvents (structured JSON) with "
                "casque's extension attributes. Errors are {\"error\": {\"code\", \"message\"}} with a "
                "stable code. Probes and metrics: GET /healthz, GET /readyz, GET /metrics (Prometheus)."
            ),
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {"schemas": definitions.get("$defs", {})},
    }
    if bearer_token:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
