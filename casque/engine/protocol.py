"""The installation's protocol version: which record formats its sidecars may write.

Each release reads every record the releases before it wrote, and writes only what the
previous release can read, so that old and new sidecars share a subscriber group and a queue
for the length of a rolling upgrade and a rollback. A record the previous release would
misread is written only from the protocol version that introduced it on, and the
installation moves to that version by one deliberate step (`casque protocol set`), taken once
every sidecar runs a release that reads it, as Kafka's `inter.broker.protocol.version` is
raised after its last broker was upgraded.

This module reads the version; casque.engine.protocol_change moves it. The version lives in one znode, `{root}/protocol` (absent: BASELINE), which every sidecar
reads and watches: every namespace may read it (it is not secret), only the installation may
write it. A sidecar that finds a version above PROTOCOL, the highest it speaks, refuses to
publish (503 `newer_format`) and is not ready, rather than write records its peers would read
as older ones.

Raising is refused while a member of any subscriber group reports a lower protocol than the
one asked for: every member's znode says what it speaks, and a member of a release before this
field says nothing, which means BASELINE. A sidecar that only publishes joins no group and is
not seen this way; `docs/operations.md` says how to check those. Lowering is always allowed:
records of the higher version stay readable by this release, and the znode says until when
records of it may still be read by a retry (`rollback_after`), after which sidecars of the
previous release may run again.

Versions:
  1  what 0.1.0 writes.
  2  producer sequences carry their claim facts on their block rows (casque.engine.sequences):
     a numbered batch writes no writer row and no completion, two statements fewer.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

from kazoo.exceptions import NoNodeError
from kazoo.recipe.watchers import DataWatch
from pydantic import BaseModel, ConfigDict, ValidationError

from casque.errors import InvalidSpec, NewerFormat
from casque.store import Store

log = logging.getLogger(__name__)

# What an installation without the znode runs: what every release reads and writes.
BASELINE = 1
# The highest version this release reads and writes.
PROTOCOL = 2
# Block rows with claim facts (casque.engine.sequences) are written from this version on.
SEQUENCE_CLAIM_FACTS = 2
# The znode's own format: a reader refuses a later one rather than misread it.
FORMAT = 1


class ProtocolRecord(BaseModel):
    """The protocol znode's data."""

    model_config = ConfigDict(frozen=True)

    format: int = FORMAT
    version: int = BASELINE
    changed_at: datetime | None = None
    # After a lowering: until when records of the higher version may still be read (a retry of
    # an id within its deduplication window). Sidecars of an older release may run after it.
    rollback_after: datetime | None = None


# What a sidecar says of itself where a raise looks (its member znodes, its presence among a
# queue's publishers): the protocol its release speaks (casque.engine.protocol_change).
SPEAKS = json.dumps({"protocol": PROTOCOL}).encode()


def protocol_path(root: str) -> str:
    return f"{root}/protocol"


def parse(data: bytes | None) -> ProtocolRecord:
    """The record in the znode's data; BASELINE for an absent or empty znode. NewerFormat for a
    format or a version this release cannot speak."""
    if not data:
        return ProtocolRecord()
    try:
        fields = json.loads(data)
    except ValueError as error:
        raise InvalidSpec(f"the protocol znode holds no JSON: {error}") from error
    if isinstance(fields, dict) and int(fields.get("format", FORMAT)) > FORMAT:
        raise NewerFormat(f"the protocol znode was written in format {fields['format']}; this version of casque "
                          f"reads up to {FORMAT}: upgrade it")
    try:
        record = ProtocolRecord.model_validate(fields)
    except ValidationError as error:
        raise InvalidSpec(f"the protocol znode is not a protocol record: {error}") from error
    if record.version > PROTOCOL:
        raise NewerFormat(f"the installation runs protocol {record.version}; this version of casque speaks up to "
                          f"{PROTOCOL}: upgrade it")
    return record


def read(store: Store) -> ProtocolRecord:
    try:
        data, _ = store.zk.get(protocol_path(store.zk_root))
    except NoNodeError:
        return ProtocolRecord()
    return parse(data)


class ProtocolLevel:
    """The protocol version this process writes in, as the installation's znode last said.

    `version` is read at every batch a publisher writes; `refusal` is set while the znode
    names a version above PROTOCOL (the process then writes nothing: see the module)."""

    def __init__(self, version: int = BASELINE) -> None:
        self.version = version
        self.refusal: NewerFormat | None = None

    @classmethod
    def of(cls, store: Store) -> ProtocolLevel:
        """The installation's level as it is now, not followed (a short-lived publisher's);
        NewerFormat if this release cannot speak it."""
        return cls(read(store).version)

    @classmethod
    def watching(cls, store: Store) -> ProtocolLevel:
        """A level that follows the installation's znode from now on (first read before returning)."""
        level = cls()
        DataWatch(store.zk, protocol_path(store.zk_root), level._changed)
        return level

    def _changed(self, data: bytes | None, *_: Any) -> None:
        try:
            record = parse(data)
        except (NewerFormat, InvalidSpec) as error:
            if not isinstance(self.refusal, NewerFormat) or str(self.refusal) != str(error):
                log.error("%s", error)
            # Nothing newer than this release can read is written; BASELINE is read by all.
            self.version = BASELINE
            self.refusal = error if isinstance(error, NewerFormat) else NewerFormat(str(error))
            return
        if record.version != self.version:
            log.info("writing records of protocol %d (was %d)", record.version, self.version)
        self.version = record.version
        self.refusal = None

    def check(self) -> None:
        """Raise the refusal, if the installation speaks a protocol above this release's."""
        if self.refusal is not None:
            raise self.refusal
