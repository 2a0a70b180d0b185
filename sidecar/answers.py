"""Publish and ack answers written straight to JSON text, not through a model per result.

A 100-message publish was answered with a `PublishResult` model per message, dumped by
pydantic: 3-4% of the sidecar's CPU publishing 100 per call (py-spy), as much again for
the `ReceiptResult`s of an ack of 100. Their fields are ids, numbers and fixed words, so
the text is written here as pydantic writes it (camelCase, unset fields left out, no
spaces). What is not plain ASCII text (an id with characters to escape, which pydantic
and the json module escape differently) or carries a time or an error goes through the
models, as before; tests/unit/test_answers.py compares both.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from casque.engine.messages import Published

# Printable ASCII but the quote and the backslash: text JSON writes as it is, alike in
# pydantic and the json module (which differ on what they escape beyond it, DEL for one).
_PLAIN = re.compile(r'[ !#-\[\]-~]*')


def published_json(results: Sequence[Published]) -> bytes | None:
    """A publishBatch answer (`PublishBatchResult`), or None to leave it to the models."""
    parts = []
    for result in results:
        one = _published(result)
        if one is None:
            return None
        parts.append(one)
    return ('{"results":[' + ",".join(parts) + "]}").encode("ascii")


def one_published_json(result: Published) -> bytes | None:
    """A publish answer (`PublishResult`), or None to leave it to the models."""
    one = _published(result)
    return None if one is None else one.encode("ascii")


def acked_json(receipts: Sequence[str], outcomes: Sequence[object]) -> bytes | None:
    """An ack answer (`ReceiptResults`) when every outcome is True (acked now) or False (acked
    before), or None to leave it to the models (an error among them)."""
    parts = []
    for receipt, outcome in zip(receipts, outcomes):
        if type(outcome) is not bool or not _plain(receipt):
            return None
        parts.append(f'{{"receipt":"{receipt}","status":"{"acked" if outcome else "already_acked"}"}}')
    return ('{"results":[' + ",".join(parts) + "]}").encode("ascii")


def _published(result: Published) -> str | None:
    if result.deliver_at is not None or not _plain(result.message_id):
        return None
    return (f'{{"messageId":"{result.message_id}","shard":{result.shard},"batch":{result.batch},'
            f'"seq":{result.seq},"duplicate":{"true" if result.duplicate else "false"}}}')


def _plain(text: str) -> bool:
    return _PLAIN.fullmatch(text) is not None
