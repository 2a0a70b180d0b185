"""JSON read as the API reads it: NaN and the infinities refused, which JSON does not have.

One decoder serves the process: `json.loads` with an option builds a new decoder and its
scanner at every call, which cost a one-message publish more than parsing its body.
"""

from __future__ import annotations

import json
from typing import Any


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse)


def loads(text: str | bytes) -> Any:
    """As `json.loads(text, parse_constant=...)` refusing NaN, Infinity and -Infinity:
    bytes in UTF-8, -16 or -32, a str without a byte order mark; ValueError otherwise."""
    if isinstance(text, bytes):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    elif text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return _DECODER.decode(text)
