"""Ack, nack and extend: bodies naming deliveries by receipt, and a result per receipt; an
ack may carry a pipeline's outputs, published with it."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from casque.schema import NAME_PATTERN
from casque.sidecar.models.base import (
    MAX_BATCH_MESSAGES,
    Body,
    ErrorBody,
    ListedReceipt,
    Receipt,
    Reply,
    Seconds,
    Text,
    Visibility,
    exactly_one_of,
    member_given,
)
from casque.sidecar.models.publishing import PublishMessage, PublishResult

MAX_RECEIPTS = 1000


class _Receipts(Body):
    receipt: Receipt | None = Field(default=None, description="One delivery; errors are answered with a 4xx.")
    receipts: Annotated[list[ListedReceipt] | None, Field(min_length=1, max_length=MAX_RECEIPTS)] = Field(
        default=None, description="Several deliveries; each gets its own result, errors included."
    )

    @model_validator(mode="after")
    def _one_form(self) -> _Receipts:
        problem = self._form_problem()
        if problem is not None:
            raise ValueError(problem)
        return self

    def _form_problem(self) -> str | None:
        if (self.receipt is None) == (self.receipts is None):
            return "give either receipt or receipts"
        return None

    @property
    def single(self) -> bool:
        return self.receipt is not None

    @property
    def all(self) -> list[str]:
        return [self.receipt] if self.receipt is not None else list(self.receipts or [])


def _outputs_without_keys(schema: dict[str, Any]) -> None:
    """An output message leaves its idempotency key to the engine: no id, producerid or producerseq."""
    messages = schema["properties"]["messages"]
    messages["items"] = {"allOf": [messages["items"], {
        "not": {"anyOf": [member_given(name) for name in ("id", "producerid", "producerseq")]}}]}


class PipelineOutputs(Body):
    """The messages an acked delivery resulted in (casque.engine.pipelines)."""

    model_config = ConfigDict(json_schema_extra=_outputs_without_keys)

    queue: Annotated[str, Field(pattern=NAME_PATTERN.pattern)] = Field(
        description="The queue of this namespace the messages go to."
    )
    messages: Annotated[list[PublishMessage], Field(min_length=1, max_length=MAX_BATCH_MESSAGES)] = Field(
        description="Published, all of them, before the delivery is acked; each exactly once per acked delivery's "
        "message and subscriber, however often the ack is sent again."
    )

    @model_validator(mode="after")
    def _keys_derived(self) -> PipelineOutputs:
        for index, message in enumerate(self.messages):
            if message.id is not None or message.producerid is not None or message.producerseq is not None:
                raise ValueError(f"messages[{index}]: an output's idempotency key is derived from the message "
                                 "it results from: leave out id, producerid and producerseq")
        return self


class PipelineAck(Body):
    receipt: ListedReceipt
    publish: PipelineOutputs | None = Field(default=None, description="What the message resulted in.")


class AckRequest(_Receipts):
    model_config = ConfigDict(json_schema_extra={
        **exactly_one_of("receipt", "receipts", "acks"),
        "if": member_given("publish"), "then": member_given("receipt"),
    })

    publish: PipelineOutputs | None = Field(
        default=None, description="With `receipt`: messages to publish as the result of the acked one, exactly "
        "once however often the ack is sent again or the message delivered again.",
    )
    acks: Annotated[list[PipelineAck] | None, Field(min_length=1, max_length=MAX_RECEIPTS)] = Field(
        default=None, description="Several deliveries, each with the messages it resulted in; each gets its own "
        "result, errors included.",
    )

    def _form_problem(self) -> str | None:
        if sum(form is not None for form in (self.receipt, self.receipts, self.acks)) != 1:
            return "give one of receipt, receipts or acks"
        if self.publish is not None and self.receipt is None:
            return "publish goes with receipt; for several deliveries, give acks"
        return None

    @property
    def all(self) -> list[str]:
        if self.acks is not None:
            return [item.receipt for item in self.acks]
        return super().all

    @property
    def pipelined(self) -> list[PipelineAck] | None:
        """Each delivery with its outputs, when any has some; None for a plain ack."""
        if self.publish is not None:
            assert self.receipt is not None
            return [PipelineAck(receipt=self.receipt, publish=self.publish)]
        return self.acks if self.acks is not None and any(a.publish for a in self.acks) else None


class NackRequest(_Receipts):
    model_config = ConfigDict(json_schema_extra=exactly_one_of("receipt", "receipts"))

    delay: Seconds | None = Field(
        default=None, description="Seconds before the message is delivered again. Left out: after the "
        "subscriber's retry backoff (`spec.retry`), or at once if it has none.",
    )
    error: Annotated[Text | None, Field(max_length=1024)] = Field(
        default=None, description="Why it failed: kept in the message's history if it is dead-lettered."
    )


class ExtendRequest(_Receipts):
    model_config = ConfigDict(json_schema_extra=exactly_one_of("receipt", "receipts"))

    visibility: Visibility = Field(description="Seconds from now during which the message stays invisible.")


class ReceiptResult(Reply):
    receipt: str
    status: Literal["acked", "already_acked", "nacked", "extended"] | None = None
    visible_until: datetime | None = None
    published: list[PublishResult] | None = Field(
        default=None, description="An ack with `publish`: where its messages are (`duplicate` when an earlier "
        "ack of the same message published them). Absent when the delivery was acked before.",
    )
    error: ErrorBody | None = None


class ReceiptResults(Reply):
    results: list[ReceiptResult] = Field(description="In the order of the request's receipts.")
