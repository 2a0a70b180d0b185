"""The CRDs in crds/ agree with casque.specs, so the API server and `casque apply` accept the same specs.

The pydantic models are the source of truth for field names, defaults, ranges and choices;
these tests fail when the CRD schemas drift from them. (The CEL rules themselves run on a
real API server in tests/integration/test_operator.py.)
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import annotated_types
import pytest
import yaml
from pydantic import BaseModel

from casque.operator import observation, readiness
from casque.operator.resources import GROUP, QUEUE_KIND, QUEUES, SUBSCRIBER_KIND, SUBSCRIBERS, VERSION
from casque.schema import NAME_PATTERN
from casque.specs import QueueSpec, SubscriberSpec

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
CHART_CRDS = ROOT / "helm" / "casque" / "crds"
DURATIONS = {"retention", "defaultDelay", "visibilityTimeout", "stallAfter", "deduplicationWindow"}


def load(name: str) -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load((CRDS / name).read_text())
    return crd


def version_of(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return dict(version)


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(version_of(crd)["schema"]["openAPIV3Schema"]["properties"]["spec"])


def status_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(version_of(crd)["schema"]["openAPIV3Schema"]["properties"]["status"])


CASES = [
    pytest.param("queue.yaml", QueueSpec, QUEUE_KIND, QUEUES, id="Queue"),
    pytest.param("subscriber.yaml", SubscriberSpec, SUBSCRIBER_KIND, SUBSCRIBERS, id="Subscriber"),
]


@pytest.mark.parametrize(("file", "model", "kind", "plural"), CASES)
def test_names_and_subresources(file: str, model: type[BaseModel], kind: str, plural: str) -> None:
    crd = load(file)
    assert crd["metadata"]["name"] == f"{plural}.{GROUP}"
    assert crd["spec"]["group"] == GROUP
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["kind"] == kind
    assert crd["spec"]["names"]["plural"] == plural
    assert crd["spec"]["names"]["shortNames"]
    version = version_of(crd)
    assert version["name"] == VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


@pytest.mark.parametrize(("file", "model", "kind", "plural"), CASES)
def test_spec_properties_are_the_model_fields(file: str, model: type[BaseModel], kind: str, plural: str) -> None:
    schema = spec_schema(load(file))
    aliases = {field.alias or name for name, field in model.model_fields.items()}
    assert set(schema["properties"]) == aliases
    required = {field.alias or name for name, field in model.model_fields.items() if field.is_required()}
    assert set(schema.get("required", [])) == required


@pytest.mark.parametrize(("file", "model", "kind", "plural"), CASES)
def test_defaults_are_the_model_defaults(file: str, model: type[BaseModel], kind: str, plural: str) -> None:
    properties = spec_schema(load(file))["properties"]
    defaults = {key: value["default"] for key, value in properties.items() if "default" in value}
    with_default = {f.alias or n for n, f in model.model_fields.items() if not f.is_required() and f.default is not None}
    assert set(defaults) == with_default
    required = {f.alias or n: "q" for n, f in model.model_fields.items() if f.is_required()}
    assert model.model_validate({**defaults, **required}) == model.model_validate(required)


@pytest.mark.parametrize(("file", "model", "kind", "plural"), CASES)
def test_ranges_and_choices_are_the_model_constraints(
    file: str, model: type[BaseModel], kind: str, plural: str
) -> None:
    properties = spec_schema(load(file))["properties"]
    for name, field in model.model_fields.items():
        schema = properties[field.alias or name]
        lower = next((m.ge for m in field.metadata if isinstance(m, annotated_types.Ge)), None)
        upper = next((m.le for m in field.metadata if isinstance(m, annotated_types.Le)), None)
        if (field.alias or name) in DURATIONS:
            # An integer or a string like 7d: the bounds are checked by CEL, in seconds.
            assert schema.get("x-kubernetes-int-or-string") is True
            rules = " ".join(rule["rule"] for rule in schema["x-kubernetes-validations"])
            for bound in (lower, upper):
                if bound is not None:
                    assert f" {bound}" in rules, (name, bound)
            continue
        assert schema.get("minimum") == lower, name
        assert schema.get("maximum") == upper, name
        choices = _literal_choices(field.annotation)
        if choices:
            assert schema["enum"] == choices, name


def test_name_fields_use_the_name_pattern() -> None:
    properties = spec_schema(load("subscriber.yaml"))["properties"]
    for key in ("queue", "deadLetterQueue"):
        assert properties[key]["pattern"] == NAME_PATTERN.pattern


def test_cel_rules_carry_the_promised_messages() -> None:
    queue = spec_schema(load("queue.yaml"))
    shards = {rule["rule"]: rule["message"] for rule in queue["properties"]["shards"]["x-kubernetes-validations"]}
    assert "self >= oldSelf" in shards and "self >= 1" in shards
    retention = queue["properties"]["retention"]["x-kubernetes-validations"]
    assert any("at least 60s" in rule["message"] for rule in retention)

    subscriber = spec_schema(load("subscriber.yaml"))
    assert any("deadLetterQueue" in rule["rule"] for rule in subscriber["x-kubernetes-validations"])
    queue_rules = subscriber["properties"]["queue"]["x-kubernetes-validations"]
    assert [rule["rule"] for rule in queue_rules] == ["self == oldSelf"]
    position = subscriber["properties"]["startPosition"]["x-kubernetes-validations"][0]
    assert "'earliest', 'latest'" in position["rule"]


@pytest.mark.parametrize(("file", "model", "kind", "plural"), CASES)
def test_printer_columns_read_fields_that_exist(file: str, model: type[BaseModel], kind: str, plural: str) -> None:
    crd = load(file)
    status = status_schema(crd)["properties"]
    spec = spec_schema(crd)["properties"]
    for column in version_of(crd)["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".status.conditions"):
            assert "conditions" in status
        elif path.startswith(".status."):
            assert path.removeprefix(".status.") in status, path
        elif path.startswith(".spec."):
            assert path.removeprefix(".spec.") in spec, path
        else:
            assert path == ".metadata.creationTimestamp"


def test_status_schema_holds_everything_the_operator_writes() -> None:
    # The status schema is closed: a field the operator writes but the schema lacks would be
    # pruned by the API server without any error.
    queue = set(status_schema(load("queue.yaml"))["properties"])
    seen = observation.QueueObservation(stored=None, table_ttl=None, heads={}, offsets={})
    assert set(readiness.queue_figures(seen)) | {"observedGeneration", "conditions", "warnings"} <= queue

    subscriber = set(status_schema(load("subscriber.yaml"))["properties"])
    spec = SubscriberSpec(queue="orders")
    watched = observation.SubscriberObservation(
        queue_exists=True, stored=spec, heads={}, offsets={}, consumers=0, dead_letter_queue_exists=None
    )
    assert set(readiness.subscriber_figures(spec, watched)) | {"observedGeneration", "conditions"} <= subscriber


def _literal_choices(annotation: Any) -> list[str]:
    """The values of a field typed as a Literal (a union such as startPosition is checked by CEL)."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(arg) for arg in typing.get_args(annotation)]
    return []


def test_the_charts_crds_are_copies_of_crds() -> None:
    """crds/ is the one source; the chart holds copies because helm warns of links on every command."""
    copies = sorted(CHART_CRDS.iterdir())
    assert [p.name for p in copies] == sorted(p.name for p in CRDS.glob("*.yaml"))
    for copy in copies:
        assert not copy.is_symlink(), f"{copy} is a link: copy it instead (cp crds/*.yaml helm/casque/crds/)"
        assert copy.read_bytes() == (CRDS / copy.name).read_bytes(), (
            f"{copy} differs from crds/{copy.name}: run cp crds/*.yaml helm/casque/crds/")
