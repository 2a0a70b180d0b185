"""Queue schemas as pure logic: which schemas are usable, how a violation reads, which changes
are backward compatible, and how a schema version is chosen (casque.dataschema, casque.engine.schema_versions)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from casque.dataschema.compatibility import incompatibilities
from casque.dataschema.validation import CompiledSchema, invalid_schema
from casque.engine import schema_versions
from casque.errors import IncompatibleSchema, SchemaViolation
from casque.schema import QueueRef
from casque.sidecar.errors import schema_refusal, status_of
from casque.sidecar.models.base import ErrorResponse
from casque.specs import QueueSpec, QueueState

ORDER: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["orderId", "lines"],
    "additionalProperties": False,
    "properties": {
        "orderId": {"type": "string", "pattern": "^o-[0-9]+$"},
        "lines": {
            "type": "array",
            "minItems": 1,
            "items": {"$ref": "#/$defs/line"},
        },
        "currency": {"enum": ["EUR", "USD"]},
        "total": {"type": "number", "minimum": 0, "maximum": 1000},
    },
    "$defs": {
        "line": {"type": "object", "required": ["sku", "quantity"],
                 "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}}},
    },
}


def changed(schema: dict[str, Any], at: tuple[str, ...], **keywords: Any) -> dict[str, Any]:
    """A deep copy of `schema` with `keywords` set (None: removed) in the subschema at `at`."""
    copy: dict[str, Any] = json.loads(json.dumps(schema))
    place = copy
    for part in at:
        place = place[part]
    for keyword, value in keywords.items():
        if value is None:
            place.pop(keyword, None)
        else:
            place[keyword] = value
    return copy


# --- which schemas a queue may have ---------------------------------------------------------
def test_a_2020_12_schema_of_supported_keywords_is_usable() -> None:
    assert invalid_schema(ORDER) is None
    assert invalid_schema({}) is None
    assert invalid_schema(True) is not None  # a queue schema is an object


@pytest.mark.parametrize(("schema", "named"), [
    ({"prefixItems": [{"type": "string"}]}, "prefixItems"),
    ({"properties": {"a": {"dependentRequired": {"a": ["b"]}}}}, "/properties/a: keyword 'dependentRequired'"),
    ({"requried": ["a"]}, "'requried'"),
    ({"items": [{"type": "string"}]}, "items must be one schema"),
    ({"$ref": "https://example.com/other.json"}, "$ref must point inside the schema"),
    ({"$schema": "http://json-schema.org/draft-07/schema#"}, "$schema must be"),
    ({"type": "whatever"}, "Unknown type"),
])
def test_unsupported_or_broken_schemas_are_refused_naming_why(schema: dict[str, Any], named: str) -> None:
    problem = invalid_schema(schema)
    assert problem is not None and named in problem


def test_the_queue_spec_refuses_an_unusable_schema_and_keeps_a_usable_one() -> None:
    with pytest.raises(ValidationError, match="prefixItems"):
        QueueSpec.model_validate({"schema": {"prefixItems": []}})
    spec = QueueSpec.model_validate({"schema": ORDER, "schemaCompatibility": "none"})
    assert spec.data_schema == ORDER and spec.schema_compatibility == "none"
    # Left out of the stored form while unset, so sidecars of the version before read the queue.
    assert "data_schema" not in QueueSpec().model_dump() and "schema_compatibility" not in QueueSpec().model_dump()


# --- checking messages ----------------------------------------------------------------------
def violation(schema: dict[str, Any], data: Any, content_type: str | None = "application/json") -> SchemaViolation:
    compiled = CompiledSchema.of(schema, version=3)
    payload = data if isinstance(data, bytes) else json.dumps(data).encode()
    with pytest.raises(SchemaViolation) as caught:
        compiled.check(payload, content_type)
    return caught.value


def test_a_matching_message_passes() -> None:
    CompiledSchema.of(ORDER, 1).check(b'{"orderId": "o-1", "lines": [{"sku": "a", "quantity": 2}]}', None)


def test_a_violation_names_the_path_into_the_data_and_the_rule() -> None:
    error = violation(ORDER, {"orderId": "o-1", "lines": [{"sku": "a", "quantity": 1}, {"sku": "b", "quantity": 0}]})
    assert (error.path, error.rule, error.version) == ("/lines/1/quantity", "minimum", 3)
    assert str(error).startswith("data at /lines/1/quantity breaks 'minimum': must be bigger than or equal to 1")
    assert "schema version 3" in str(error)


@pytest.mark.parametrize(("data", "path", "rule"), [
    ({"lines": [{"sku": "a", "quantity": 1}]}, "", "required"),
    ({"orderId": "x", "lines": [{"sku": "a", "quantity": 1}]}, "/orderId", "pattern"),
    ({"orderId": "o-1", "lines": []}, "/lines", "minItems"),
    ({"orderId": "o-1", "lines": [{"sku": "a", "quantity": 1}], "currency": "JPY"}, "/currency", "enum"),
    ({"orderId": "o-1", "lines": [{"sku": "a", "quantity": 1}], "extra": 1}, "", "additionalProperties"),
    ([1], "", "type"),
])
def test_each_rule_is_reported_where_it_failed(data: Any, path: str, rule: str) -> None:
    error = violation(ORDER, data)
    assert (error.path, error.rule) == (path, rule)


def test_a_pointer_escapes_slashes_and_tildes_in_names() -> None:
    schema = {"properties": {"a/b~c": {"type": "string"}}}
    assert violation(schema, {"a/b~c": 1}).path == "/a~1b~0c"


def test_data_that_is_not_json_is_refused_on_a_queue_with_a_schema() -> None:
    assert violation({}, b"plain", "text/plain").rule == "contentType"
    assert violation({}, b"{not json", "application/json").rule == "contentType"
    CompiledSchema.of({}, 1).check(b"[]", "application/cloudevents+json")  # +json is JSON


def test_formats_are_annotations_and_defaults_fill_nothing_in() -> None:
    schema = {"properties": {"at": {"type": "string", "format": "date-time"}, "n": {"default": 5}}}
    CompiledSchema.of(schema, 1).check(b'{"at": "not a time"}', None)


def test_the_sidecar_renders_a_violation_as_a_400_with_code_path_and_rule() -> None:
    error = violation(ORDER, {"orderId": "o-1", "lines": [{"sku": "a"}]})
    refusal = schema_refusal(error, index=2)
    assert status_of(refusal) == 400 and refusal.code == "schema_violation"
    assert str(refusal).startswith("messages[2]: data at /lines/0 breaks 'required'")
    (detail,) = refusal.details or []
    body = ErrorResponse.model_validate({"error": {"code": refusal.code, "message": str(refusal),
                                                   "details": [detail.wire()]}}).wire()
    assert body["error"]["details"] == [{
        "field": "messages[2].data", "problem": str(error), "path": "/lines/0", "rule": "required",
        "schemaVersion": 3,
    }]
    assert schema_refusal(error, index=None).details[0].field == "data"  # type: ignore[index]


# --- backward compatibility -----------------------------------------------------------------
LINE = ("$defs", "line")
TOTAL = ("properties", "total")


@pytest.mark.parametrize("new", [
    ORDER,
    changed(ORDER, (), title="Orders", description="annotations never matter"),
    changed(ORDER, (), required=["orderId"]),  # removing a required name
    changed(ORDER, ("properties", "currency"), enum=["EUR", "USD", "GBP"]),  # widening an enum
    changed(ORDER, ("properties", "currency"), enum=None),  # dropping it
    changed(ORDER, TOTAL, minimum=-10, maximum=5000),  # relaxing bounds
    changed(ORDER, TOTAL, type=["number", "null"]),  # widening a type
    changed(ORDER, ("properties", "orderId"), pattern=None),
    changed(ORDER, ("properties", "lines"), minItems=None),
    changed(ORDER, ("properties",), note={"type": "string"}),  # a new optional property of a closed object
    changed(ORDER, (), additionalProperties=None),  # opening the object
    {},  # a schema that accepts everything
])
def test_compatible_changes(new: dict[str, Any]) -> None:
    assert incompatibilities(ORDER, new) == []


@pytest.mark.parametrize(("new", "reason"), [
    (changed(ORDER, (), required=["orderId", "lines", "total"]), "/: required adds total"),
    (changed(ORDER, ("properties", "currency"), enum=["EUR"]), "/properties/currency: enum no longer allows ['USD']"),
    (changed(ORDER, TOTAL, maximum=500), "/properties/total: maximum lowered from 1000 to 500"),
    (changed(ORDER, TOTAL, minimum=1), "/properties/total: minimum raised from 0 to 1"),
    (changed(ORDER, TOTAL, type="integer"), "/properties/total: type no longer allows number"),
    (changed(ORDER, TOTAL, multipleOf=0.5), "/properties/total: multipleOf 0.5 added"),
    (changed(ORDER, ("properties", "orderId"), maxLength=10), "/properties/orderId: maxLength 10 added"),
    (changed(ORDER, ("properties", "orderId"), pattern="^o-"), "/properties/orderId: pattern changed"),
    (changed(ORDER, LINE, minProperties=1), "/: $defs changed"),
    (changed(ORDER, ("properties",), total=None), "/properties/total: the new schema accepts nothing here"),
])
def test_incompatible_changes_name_the_place_and_the_keyword(new: dict[str, Any], reason: str) -> None:
    assert reason in incompatibilities(ORDER, new)


def test_a_new_property_of_an_open_object_is_incompatible_unless_it_accepts_anything() -> None:
    open_object = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert incompatibilities(open_object, changed(open_object, ("properties",), b={"type": "string"})) == [
        "/properties/b: type 'string' added"]
    assert incompatibilities(open_object, changed(open_object, ("properties",), b={"description": "any"})) == []


def test_values_compare_as_json_not_as_python() -> None:
    # Python says True == 1; JSON Schema does not: 1 is not the boolean true.
    assert incompatibilities({"const": True}, {"const": 1}) == ["/: const changed"]
    assert incompatibilities({"enum": [True, "a"]}, {"enum": [1, "a"]}) == ["/: enum no longer allows [True]"]
    assert incompatibilities({"anyOf": [{"const": False}]}, {"anyOf": [{"const": 0}]}) != []


def test_bounds_and_alternatives() -> None:
    assert incompatibilities({"multipleOf": 4}, {"multipleOf": 2}) == []
    assert incompatibilities({"multipleOf": 0.3}, {"multipleOf": 0.1}) == []
    assert incompatibilities({"multipleOf": 2}, {"multipleOf": 4}) != []
    assert incompatibilities({"anyOf": [{"type": "string"}]}, {"anyOf": [{"type": "string"}, {"type": "null"}]}) == []
    assert incompatibilities({"anyOf": [{"type": "string"}, {"type": "null"}]}, {"anyOf": [{"type": "string"}]})
    assert incompatibilities({"allOf": [{"minimum": 1}, {"maximum": 5}]}, {"allOf": [{"minimum": 1}]}) == []
    assert incompatibilities({"const": "a"}, {"enum": ["a", "b"]}) == []
    assert incompatibilities({"uniqueItems": True}, {"uniqueItems": False}) == []
    assert incompatibilities({}, {"uniqueItems": True}) == ["/: uniqueItems turned on"]
    assert incompatibilities(False, {"type": "string"}) == []
    assert incompatibilities({"items": {"type": "string"}}, {"items": {"type": "integer"}}) == [
        "/items: type no longer allows string"]


# --- versions -------------------------------------------------------------------------------
QUEUE = QueueRef("default", "orders")


def state(schema: dict[str, Any] | None, version: int) -> QueueState:
    return QueueState(spec=QueueSpec.model_validate({"schema": schema}), created_at=datetime.now(timezone.utc),
                      schema_version=version)


def test_a_new_queue_starts_at_version_one_with_a_schema_and_zero_without() -> None:
    assert schema_versions.first_version(QUEUE, QueueSpec.model_validate({"schema": ORDER})) == 1
    assert schema_versions.first_version(QUEUE, QueueSpec()) == 0


def test_an_unchanged_schema_keeps_its_version_whatever_its_key_order() -> None:
    reordered = dict(reversed(list(ORDER.items())))
    assert schema_versions.next_version(QUEUE, state(ORDER, 4), QueueSpec.model_validate({"schema": reordered})) == 4


def test_a_compatible_change_takes_the_next_version() -> None:
    wider = changed(ORDER, TOTAL, maximum=5000)
    assert schema_versions.next_version(QUEUE, state(ORDER, 4), QueueSpec.model_validate({"schema": wider})) == 5
    # Removing the schema accepts everything: a new version too, which messages then do not carry.
    assert schema_versions.next_version(QUEUE, state(ORDER, 5), QueueSpec()) == 6


def test_an_incompatible_change_is_refused_unless_compatibility_is_none() -> None:
    narrower = changed(ORDER, TOTAL, maximum=10)
    with pytest.raises(IncompatibleSchema, match=r"version 4, which stays in force: /properties/total: maximum"):
        schema_versions.next_version(QUEUE, state(ORDER, 4), QueueSpec.model_validate({"schema": narrower}))
    forced = QueueSpec.model_validate({"schema": narrower, "schemaCompatibility": "none"})
    assert schema_versions.next_version(QUEUE, state(ORDER, 4), forced) == 5


def test_a_first_schema_on_an_existing_queue_needs_compatibility_none() -> None:
    with pytest.raises(IncompatibleSchema):
        schema_versions.next_version(QUEUE, state(None, 0), QueueSpec.model_validate({"schema": ORDER}))
    forced = QueueSpec.model_validate({"schema": ORDER, "schemaCompatibility": "none"})
    assert schema_versions.next_version(QUEUE, state(None, 0), forced) == 1
