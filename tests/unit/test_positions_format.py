"""Position znodes (heads, totals, offsets, cursors): format 1 read as it always was, a later
format refused by name rather than read as numbers of format 1."""

from __future__ import annotations

import pytest

from casque.errors import NewerFormat
from casque.znodes import decode_head, decode_offset, decode_totals, encode_offset, encode_totals


def test_format_1_reads_as_every_release_wrote_it() -> None:
    assert decode_head(None) == decode_head(b"") == 0
    assert decode_head(b"812") == 812
    assert decode_offset(None) == (1, 0)
    assert decode_offset(encode_offset(17)) == (17, 0)
    assert decode_offset(encode_offset(17, 3)) == (17, 3)
    assert decode_totals(b"") is None
    assert decode_totals(encode_totals(4, 100, 2048)) == (4, 100, 2048)


@pytest.mark.parametrize(("decode", "data", "named"), [
    (decode_head, b"812#2", "a head '812' was written in format 2"),
    (decode_offset, b"17@3#2", "an offset or cursor '17@3' was written in format 2"),
    (decode_totals, b"4 100 2048#7", "a shard's totals '4 100 2048' was written in format 7"),
], ids=["head", "offset", "totals"])
def test_a_later_format_is_refused_naming_the_record_and_its_format(decode: object, data: bytes, named: str) -> None:
    with pytest.raises(NewerFormat) as refused:
        decode(data)  # type: ignore[operator]
    assert str(refused.value).startswith(named)
    assert "this version of casque reads up to 1" in str(refused.value)
