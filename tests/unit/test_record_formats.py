"""Records with no format field of their own (batches, ack rows, receipts, publish-id records):
format 1 read as every release wrote it, a later format refused by name rather than misread
(casque.formats)."""

from __future__ import annotations

import base64
from datetime import datetime, timezone

import pytest

from casque.engine.acks import ACK, NACK, BatchMarks
from casque.engine.batches import _header_from_tuple
from casque.engine.messages import InvalidReceipt, Position, decode_receipt, encode_receipt
from casque.errors import NewerFormat
from casque.formats import unmarked

PUBLISHED = datetime(2026, 12, 3, tzinfo=timezone.utc)


def header_row(writer: str | None) -> tuple[object, ...]:
    """A header row as a read of the log selects it (casque.engine.batches._READ_COLUMNS)."""
    return (7, -1, None, PUBLISHED, None, None, None, None, None, writer, 2, 40, 800)


def test_format_1_records_read_as_every_release_wrote_them() -> None:
    assert unmarked("3f2a/9c41", "a writer") == "3f2a/9c41"
    header = _header_from_tuple(header_row("3f2a/9c41"))
    assert (header.batch, header.writer, header.message_count) == (7, "3f2a/9c41", 2)
    assert _header_from_tuple(header_row(None)).writer is None
    marks = BatchMarks()
    marks.add_row(ACK, {1}, None, None)
    marks.add_row(None, None, {2: 1}, {2: 5000})
    marks.add_row(NACK, None, {3: 1}, {3: 9000})
    assert (marks.done, marks.visible_until, marks.waiting_until(3)) == ({1}, {2: 5000}, 9000)
    receipt = encode_receipt(Position(3, 812, 4), 99)
    assert decode_receipt(receipt) == (Position(3, 812, 4), 99)


def test_a_batch_whose_writer_is_marked_is_refused_with_its_number() -> None:
    with pytest.raises(NewerFormat, match=r"^batch 7's writer '3f2a/9c41' was written in format 2; this version "
                                          r"of casque reads up to 1: upgrade it$"):
        _header_from_tuple(header_row("3f2a/9c41#2"))


@pytest.mark.parametrize(("outcome", "named"), [
    ("ack#2", "an ack row of kind 'ack' was written in format 2"),
    ("skip", "an ack row of kind 'skip' was written by a later version of casque"),
], ids=["marked", "unknown kind"])
def test_an_ack_row_of_a_later_format_is_refused_not_folded_in_as_a_delivery(outcome: str, named: str) -> None:
    marks = BatchMarks()
    with pytest.raises(NewerFormat) as refused:
        marks.add_row(outcome, {1}, {1: 3}, {1: 5000})
    assert str(refused.value).startswith(named)
    assert marks == BatchMarks(), "nothing of the row was taken"


def test_a_receipt_of_another_length_is_not_read_as_a_position() -> None:
    """A later format of receipt will be of another length than 24 bytes: refused as not one
    this release reads, never decoded as a shard, batch and seq."""
    longer = base64.urlsafe_b64encode(bytes([2]) + bytes(30)).decode().rstrip("=")
    with pytest.raises(InvalidReceipt, match="not a receipt this version of casque reads"):
        decode_receipt(longer)
    for garbage in ("not-a-receipt", base64.urlsafe_b64encode(bytes([200]) + bytes(5)).decode(), ""):
        with pytest.raises(InvalidReceipt):
            decode_receipt(garbage)


def test_every_refusal_is_counted_for_the_sidecars_metric() -> None:
    before = NewerFormat.refusals
    with pytest.raises(NewerFormat):
        unmarked("812#2", "a head")
    assert NewerFormat.refusals == before + 1
