"""Moving the installation's protocol version (casque.engine.protocol says what it is).

Raising is refused while a member of any subscriber group, or a sidecar present among any
queue's publishers (casque.engine.presence: one that only publishes joins no group), speaks
less than the version asked for. A sidecar of a release before the presences (0.1.0) that
only publishes is in neither, and is not seen. Before the znode changes, every keyspace of the installation gets the columns the new
version's records need (the operator adds them at its first apply after an upgrade too), so
no sidecar meets a record its statements cannot read. Lowering is always allowed, and says
until when records of the higher version may still be read by a retry: sidecars of the
previous release may run again after that (`rollback_after`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from kazoo.exceptions import BadVersionError, NoNodeError, NodeExistsError

from casque.engine import catalog
from casque.engine.protocol import BASELINE, PROTOCOL, ProtocolRecord, parse, protocol_path
from casque.errors import CasqueError, InvalidSpec, QueueNotFound
from casque.store import Store


class OlderMembers(CasqueError):
    """A raise of the protocol refused: members that speak less than it are still running."""

    code = "older_members"


def member_protocol(data: bytes | None) -> int:
    """The protocol a member znode's data says its sidecar speaks: BASELINE when it says none
    (a release before the field, whose znode is empty or holds its counters alone)."""
    if not data:
        return BASELINE
    try:
        fields = json.loads(data)
    except ValueError:
        return BASELINE
    value = fields.get("protocol") if isinstance(fields, dict) else None
    return value if isinstance(value, int) else BASELINE


@dataclass(frozen=True)
class Member:
    """A sidecar seen in a subscriber group, or (`subscriber` None) among a queue's publishers."""

    queue: str
    subscriber: str | None
    member: str
    protocol: int

    def __str__(self) -> str:
        if self.subscriber is None:
            return f"{self.queue} publisher {self.member} (protocol {self.protocol})"
        return f"{self.queue}/{self.subscriber} member {self.member} (protocol {self.protocol})"


def members(store: Store) -> Iterator[Member]:
    """Every live member of every subscriber group of the installation, with its protocol."""
    for queue in catalog.list_queues(store):
        for subscriber in catalog.list_subscribers(store, queue):
            yield from _speakers(store, str(queue), subscriber, store.paths(queue).subscriber(subscriber).members)


def publishers(store: Store) -> Iterator[Member]:
    """Every sidecar present among the publishers of a queue of the installation, with its protocol."""
    for queue in catalog.list_queues(store):
        yield from _speakers(store, str(queue), None, store.paths(queue).publishers)


def _speakers(store: Store, queue: str, subscriber: str | None, container: str) -> Iterator[Member]:
    try:
        names = sorted(store.zk.get_children(container))
    except NoNodeError:
        return
    for name in names:
        try:
            data, _ = store.zk.get(f"{container}/{name}")
        except NoNodeError:
            continue  # left meanwhile
        yield Member(queue, subscriber, name, member_protocol(data))


def prepare_installation(store: Store) -> int:
    """Every keyspace of the installation with the tables and columns this release writes;
    returns the longest deduplication window of its queues (seconds), which bounds how long a
    record written under one protocol version is read by a retry."""
    catalog.ensure_installation(store)
    longest = 0
    namespaces: set[str] = set()
    for queue in catalog.list_queues(store):
        if queue.namespace not in namespaces:
            catalog.ensure_namespace_keyspace(store, queue.namespace)
            namespaces.add(queue.namespace)
        try:
            state = catalog.read_queue(store, queue, granted=False)
        except QueueNotFound:
            continue  # deleted meanwhile
        longest = max(longest, state.spec.deduplication_window)
    return longest


@dataclass(frozen=True)
class ProtocolChange:
    before: int
    after: int
    rollback_after: datetime | None

    def describe(self) -> str:
        if self.after == self.before:
            return f"protocol {self.after} (unchanged)"
        line = f"protocol {self.before} -> {self.after}"
        if self.rollback_after is not None:
            line += (f"; records of protocol {self.before} may be read until "
                     f"{self.rollback_after.isoformat(timespec='seconds')}: roll sidecars back after that")
        return line


def set_version(store: Store, version: int, force: bool = False, now: datetime | None = None) -> ProtocolChange:
    """Move the installation to `version`. Raising is refused (OlderMembers) while a member
    speaks less, unless `force`."""
    if not BASELINE <= version <= PROTOCOL:
        raise InvalidSpec(f"protocol {version} is not one this version of casque speaks ({BASELINE}-{PROTOCOL})")
    window_seconds = prepare_installation(store)
    path = protocol_path(store.zk_root)
    now = now or datetime.now(timezone.utc)
    while True:
        try:
            data, stat = store.zk.get(path)
        except NoNodeError:
            data, stat = b"", None
        current = parse(data)
        if version > current.version and not force:
            older = [m for m in itertools.chain(members(store), publishers(store)) if m.protocol < version]
            if older:
                shown = "; ".join(str(m) for m in older[:5]) + (f"; and {len(older) - 5} more" if len(older) > 5 else "")
                raise OlderMembers(f"protocol {version} refused: {len(older)} sidecar(s) speak less: {shown}. "
                                   "Upgrade them first (or --force, which risks publishes stored twice)")
        if version == current.version:
            return ProtocolChange(current.version, version, current.rollback_after)
        rollback_after = current.rollback_after
        if version < current.version:
            later = now + timedelta(seconds=window_seconds)
            rollback_after = later if rollback_after is None else max(rollback_after, later)
        record = ProtocolRecord(version=version, changed_at=now, rollback_after=rollback_after)
        body = record.model_dump_json(exclude_none=True).encode()
        try:
            if stat is None:
                store.zk.create(path, body, makepath=True)
            else:
                store.zk.set(path, body, version=stat.version)
        except (NodeExistsError, BadVersionError):
            continue  # changed meanwhile: judged again against what it is now
        return ProtocolChange(current.version, version, rollback_after if version < current.version else None)
