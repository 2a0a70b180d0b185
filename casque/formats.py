"""Format marks: how a stored record that has no `format` field of its own says which format it is in.

Records written as JSON (queue and subscriber znodes, catalog and checkpoint rows, a
backup's manifest) carry a `format` field. The others are read by every release through a
text field their readers take first, and that field carries the format instead:

    position znodes (heads, totals, offsets, cursors)   after the numbers        "812#2"
    a batch (its header's writer id; its message ids    after the writer id      "3f2a.../9c41...#2"
      and rows are the batch's format)
    publish-id records (client ids, producer seqs;       after the writer id      as above
      the writer rows they point at)
    ack rows                                             after the kind           "ack#2"; a kind this
                                                                                  release does not know
                                                                                  is a later format's
    receipts (handed to apps, not stored)                their length             24 bytes; another is
                                                                                  refused as not a receipt

Format 1 is every record as the releases so far wrote it: unmarked. A release writes format
1 until the installation's protocol version (casque.engine.protocol) says a later one may be
written, and refuses a later format by name (NewerFormat) rather than read it as format 1's.
"""

from __future__ import annotations

from casque.errors import NewerFormat

# The format of the unmarked records this release reads and writes.
UNMARKED_FORMAT = 1
FORMAT_MARK = "#"


def unmarked(text: str, what: str) -> str:
    """`text` of a record in format 1; NewerFormat, naming `what`, if it is marked with a later one."""
    if FORMAT_MARK not in text:
        return text
    value, _, format_ = text.partition(FORMAT_MARK)
    raise NewerFormat(f"{what} {value!r} was written in format {format_}; this version of casque reads up to "
                      f"{UNMARKED_FORMAT}: upgrade it")


def unmarked_or_none(text: str | None, what: str) -> str | None:
    return None if text is None else unmarked(text, what)
