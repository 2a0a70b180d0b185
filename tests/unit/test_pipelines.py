"""Acks that publish: the derived keys, and the request forms the API takes and refuses."""

import pytest
from pydantic import ValidationError

from casque.engine.messages import OutgoingMessage, reserved_client_id
from casque.engine.pipelines import keyed_outputs, output_client_id
from casque.sidecar.models.publishing import PublishMessage
from casque.sidecar.models.receipts import AckRequest


def test_each_output_is_keyed_by_subscriber_input_and_index_and_remembered_for_the_inputs_retention() -> None:
    outputs = [OutgoingMessage(b"line 1", client_id="ignored"), OutgoingMessage(b"line 2", key="o-42")]
    keyed = keyed_outputs(outputs, "billing#7f3a", "m-1", 7 * 86400)
    assert [o.client_id for o in keyed] == ["pipe/billing#7f3a/m-1/0", "pipe/billing#7f3a/m-1/1"]
    assert all(o.client_id_window_seconds == 7 * 86400 for o in keyed)
    assert [(o.payload, o.key) for o in keyed] == [(b"line 1", None), (b"line 2", "o-42")]
    # Another subscriber, input or index is another key; the same ones, the same key.
    assert len({output_client_id(s, i, n) for s in ("a#1", "b#1") for i in ("m-1", "m-2") for n in (0, 1)}) == 8
    assert output_client_id("billing#7f3a", "m-1", 0) == keyed[0].client_id


# A receipt sent alone has a receipt's form; one of a list may be anything of its alphabet.
RECEIPT = "A" * 32


def test_an_app_cannot_publish_under_a_pipeline_key() -> None:
    assert reserved_client_id(output_client_id("billing#1", "m-1", 0))
    with pytest.raises(ValidationError, match="ids starting with"):
        PublishMessage.model_validate({"data": 1, "id": "pipe/billing#1/m-1/0"})


def test_an_ack_takes_one_form_and_outputs_without_keys_of_their_own() -> None:
    outputs = {"queue": "invoices", "messages": [{"data": {"line": 1}}]}
    single = AckRequest.model_validate({"receipt": RECEIPT, "publish": outputs})
    assert single.single and single.all == [RECEIPT] and single.pipelined is not None
    several = AckRequest.model_validate({"acks": [{"receipt": "AAAA", "publish": outputs}, {"receipt": "BBBB"}]})
    assert not several.single and several.all == ["AAAA", "BBBB"] and several.pipelined is not None
    assert AckRequest.model_validate({"acks": [{"receipt": "AAAA"}]}).pipelined is None
    assert AckRequest.model_validate({"receipts": ["AAAA"]}).pipelined is None
    for bad, why in [
        ({"receipts": ["AAAA"], "publish": outputs}, "publish goes with receipt"),
        ({"receipt": RECEIPT, "acks": [{"receipt": "BBBB"}]}, "one of receipt, receipts or acks"),
        ({}, "one of receipt, receipts or acks"),
        ({"receipt": RECEIPT, "publish": {"queue": "invoices", "messages": [{"data": 1, "id": "x"}]}},
         "idempotency key is derived"),
        ({"receipt": RECEIPT, "publish": {"queue": "invoices", "messages": [{"data": 1, "producerid": "p",
                                                                             "producerseq": 1}]}},
         "idempotency key is derived"),
        ({"receipt": RECEIPT, "publish": {"queue": "Invoices!", "messages": [{"data": 1}]}}, "queue"),
        ({"receipt": RECEIPT, "publish": {"queue": "invoices", "messages": []}}, "messages"),
    ]:
        with pytest.raises(ValidationError, match=why):
            AckRequest.model_validate(bad)
