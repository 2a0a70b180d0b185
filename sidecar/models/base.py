"""What every body of the sidecar API shares: the limits, the field types and their checks,
the request and reply bases (`Body`, `Reply`), and the error body."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.alias_generators import to_camel

from casque.engine.messages import EVENT_ATTRIBUTES
from casque.instants import in_utc

MAX_BATCH_MESSAGES = 1000
MAX_VISIBILITY_SECONDS = 12 * 3600
# CloudEvents attributes of a published event ride in these message attributes.
CE_ATTRIBUTES = EVENT_ATTRIBUTES


def encodable(value: str) -> str:
    # A JSON string may carry an unpaired surrogate ("\ud800"); Cassandra's text columns
    # and our size accounting need real UTF-8, so refuse it here as bad input.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError("text must be valid Unicode (no unpaired surrogates)") from error
    return value


Text = Annotated[str, AfterValidator(encodable)]


def _integral(value: object) -> object:
    """JSON has one kind of number: 47.0 is the integer 47, as JSON Schema's `integer` says
    (the document promises that); any other float stays one and is refused as not an integer."""
    return int(value) if type(value) is float and value.is_integer() else value


# After an int's own constraints (`Annotated[int, Field(...), INTEGRAL]`): so they stay in its JSON Schema.
INTEGRAL = BeforeValidator(_integral)


# Rules between members that no one member's schema says, for the OpenAPI document. A member
# sent as null counts as left out, as the validators below read it.
def member_given(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def exactly_one_of(*names: str) -> dict[str, Any]:
    # (A client generator may need to be told to keep the properties beside a oneOf of
    # `required` alone: openapi-generator's REMOVE_ANYOF_ONEOF_AND_KEEP_PROPERTIES_ONLY.)
    return {"oneOf": [member_given(name) for name in names]}


def together(first: str, second: str) -> list[dict[str, Any]]:
    return [{"if": member_given(first), "then": member_given(second)},
            {"if": member_given(second), "then": member_given(first)}]


def not_both(first: str, second: str) -> dict[str, Any]:
    return {"not": {"allOf": [member_given(first), member_given(second)]}}


Instant = Annotated[AwareDatetime, AfterValidator(in_utc)]


AttributeName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:/-]{1,128}$"), AfterValidator(encodable)]
# A receipt is 24 bytes (casque.engine.messages.encode_receipt) in unpadded base64url: 32
# characters. One sent alone must be one; one of a list may be anything of its alphabet, and
# a malformed one gets its own `invalid_receipt` result beside the others'.
Receipt = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{32}$")]
ListedReceipt = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_-]+$")]
Seconds = Annotated[float, Field(ge=0, le=MAX_VISIBILITY_SECONDS)]
Visibility = Annotated[float, Field(gt=0, le=MAX_VISIBILITY_SECONDS)]


# `defer_build`: a model's validator and serializer are built at its first use, not at
# import. Most calls take the quick paths (decoding.py, rendering.py, answers.py), so a
# sidecar that never meets a body they leave to the models never builds those: 1.4 MiB of
# RSS for the models below. The first call that needs one waits for its build (a few ms).


class Body(BaseModel):
    """A request body: strict JSON types, no unknown fields, finite numbers."""

    model_config = ConfigDict(defer_build=True, extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class Reply(BaseModel):
    """A response body: camelCase on the wire."""

    model_config = ConfigDict(defer_build=True, alias_generator=to_camel, populate_by_name=True)

    def wire(self) -> dict[str, Any]:
        # Fields left unset (optional ones such as `error`) are left out; a field set to
        # None on purpose (an unknown count) is sent as null.
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def wire_json(self) -> bytes:
        """`wire()` as JSON text, serialised by pydantic's own encoder: the HTTP answers use
        this, since going through dicts and the json module cost twice as much for a
        receive of 100 messages."""
        return self.model_dump_json(by_alias=True, exclude_unset=True).encode()


# --- errors -------------------------------------------------------------------------------
class ErrorDetail(Reply):
    field: str
    problem: str
    # Set for a schema violation (code schema_violation): where in the message's data
    # (a JSON pointer, "" for the whole), the schema keyword that failed, and the version.
    path: str | None = Field(default=None, description="JSON pointer into the message's data (schema_violation).")
    rule: str | None = Field(default=None, description="The schema keyword that failed (schema_violation).")
    schema_version: int | None = Field(default=None, description="The queue schema version checked against.")
    code: str | None = Field(default=None, description="This part's own error code (partially_published: why "
                             "each message not written was not, e.g. backend_unavailable or publish_outcome_unknown).")


class ErrorBody(Reply):
    code: str = Field(description="Stable, machine-readable: queue_not_found, stale_receipt, ...")
    message: str = Field(description="For people; wording may change.")
    details: list[ErrorDetail] | None = None


class ErrorResponse(Reply):
    error: ErrorBody


def is_json_type(content_type: str | None) -> bool:
    """Whether a content type is JSON (absent: JSON too, the default of `data`)."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("application/json", "text/json") or media.endswith("+json")
