"""Publish and ack answers written by answers.py are the bytes the models write."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from casque.engine.messages import Published
from casque.errors import StaleReceipt
from casque.sidecar.answers import acked_json, one_published_json, published_json
from casque.sidecar.models.publishing import PublishBatchResult, PublishResult
from casque.sidecar.models.receipts import ReceiptResult, ReceiptResults

PUBLISHED = [
    Published("0f9c1e7a-3b1d-4c0e-9a51-7a0d3c2b1e4f", 0, 1, 0),
    Published("0f9c1e7a-3b1d-4c0e-9a51-7a0d3c2b1e4f", 3_000_001, 2**62, 999, duplicate=True),
    Published("odd id: !#$%&'()*+,-./:;<=>?@[]^_`{|}~", 1, 2, 3),
]


def test_published_answers_are_the_models_bytes() -> None:
    assert published_json(PUBLISHED) == PublishBatchResult(results=[PublishResult.of(r) for r in PUBLISHED]).wire_json()
    for result in PUBLISHED:
        assert one_published_json(result) == PublishResult.of(result).wire_json()


@pytest.mark.parametrize("result", [
    Published("m", -1, -1, -1, deliver_at=datetime(2030, 1, 1, tzinfo=timezone.utc)),  # a time: the models write it
    Published('quote"d', 0, 1, 2), Published("back\\slash", 0, 1, 2), Published("del\x7f", 0, 1, 2),
    Published("caf\u00e9", 0, 1, 2), Published("tab\t", 0, 1, 2),
])
def test_what_needs_escaping_or_a_time_is_left_to_the_models(result: Published) -> None:
    assert one_published_json(result) is None
    assert published_json([PUBLISHED[0], result]) is None


def test_ack_answers_are_the_models_bytes() -> None:
    receipts = ["AAAAAAAAAAEAAAAAAAAAAQ", "b-_9"]
    answer = ReceiptResults(results=[ReceiptResult(receipt="AAAAAAAAAAEAAAAAAAAAAQ", status="acked"),
                                     ReceiptResult(receipt="b-_9", status="already_acked")])
    assert acked_json(receipts, [True, False]) == answer.wire_json()


def test_an_ack_with_an_error_is_left_to_the_models() -> None:
    assert acked_json(["a", "b"], [True, StaleReceipt("moved on")]) is None
    assert acked_json(['a"'], [True]) is None
