"""The API's JSON reader: json.loads' answers, NaN and the infinities refused."""

from __future__ import annotations

import json

import pytest

from casque.sidecar import strictjson


@pytest.mark.parametrize("text", [
    '{"a": [1, 2.5, -0, 1e400, "x\\u00e9"]}', "[]", '"\\ud83d\\ude00"', "null", ' {"nested": {"deep": [true]}} ',
])
def test_it_reads_what_json_loads_reads(text: str) -> None:
    for form in (text, text.encode("utf-8"), text.encode("utf-16"), text.encode("utf-32-le")):
        assert strictjson.loads(form) == json.loads(form)


@pytest.mark.parametrize("text", ["NaN", '{"a": Infinity}', "[-Infinity]", "\ufeff{}", "{", '{"a": 1} x'])
def test_it_refuses_what_json_has_not(text: str) -> None:
    with pytest.raises(ValueError):
        strictjson.loads(text)
    if not text.startswith("\ufeff"):  # as bytes, a BOM names the encoding
        with pytest.raises(ValueError):
            strictjson.loads(text.encode("utf-8"))
