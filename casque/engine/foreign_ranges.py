"""Ordered keys in shared delivery: what one member knows of the other members' ranges.

A keyed message may be handed out only when no earlier message of its key is open anywhere:
in this member's ranges (KeyLocks) or in another member's range below it. Ranges carry the
hashes of their keys (casque.engine.claims), so this keeps, per shard, the names of the open
claims (a children watch) and the records of other members' ranges as read; a range not
read yet holds every key back until it is (`KeyLocks.hold` gets None). A range's
holder rewrites its key set as keys finish there; a data watch on each range read has it
read again, and a range that completes goes from the children watch; either wakes the
receives waiting on its keys.

Connection loss: a watch that lapses leaves the names as last seen, which only holds keys
back longer; a range read that fails is read again on the next receive, as is one whose
watch ended with an expired session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kazoo.protocol.states import EventType, WatchedEvent
from kazoo.recipe.watchers import ChildrenWatch

from casque.backends import zk
from casque.engine import claims
from casque.engine.claims import ClaimRecord
from casque.engine.keylocks import KeyLocks
from casque.engine.member import Member
from casque.backends.loop_handoff import call_soon_unless_closed
from casque.errors import CasqueError

log = logging.getLogger(__name__)


class ForeignRanges:
    def __init__(self, member: Member, held: Callable[[int], set[str]], epoch_of: Callable[[int], int | None],
                 active: Callable[[], bool]) -> None:
        """`held`: names of this member's ranges of a shard; `epoch_of`: the shard's seek epoch as
        last read (ranges of other epochs are moot); `active`: false once the member stops."""
        self._member = member
        self.client = member.store.zk
        self.paths = member.paths
        self._held = held
        self._epoch_of = epoch_of
        self._active = active
        self._locks: dict[int, KeyLocks] = {}
        # Claim names per shard (a watch), and other members' ranges read so far.
        self._names: dict[int, set[str] | None] = {}
        self._known: dict[tuple[int, str], ClaimRecord] = {}
        self._learning: set[tuple[int, str]] = set()
        self._stale: set[tuple[int, str]] = set()

    def locks_for(self, shard: int) -> KeyLocks:
        locks = self._locks.get(shard)
        if locks is None:
            locks = self._locks[shard] = KeyLocks(foreign=lambda batch: self._foreign_keys(shard, batch),
                                                  on_release=self._member.notify)
        return locks

    def _foreign_keys(self, shard: int, batch: int) -> list[frozenset[int]] | None:
        """Key hashes of the open ranges of other members below `batch`; None while one is unknown."""
        names = self._names.get(shard)
        epoch_now = self._epoch_of(shard)
        if names is None or epoch_now is None:
            return None
        held = self._held(shard)
        found: list[frozenset[int]] = []
        unknown = False
        for name in names - held:
            epoch, _, start = name.partition("-")
            if int(epoch) != epoch_now or int(start) >= batch:
                continue
            record = self._known.get((shard, name))
            if record is None:
                self._learn(shard, name)  # every one not known is read at once, not one per receive
                unknown = True
                continue
            found.append(record.keys)
        return None if unknown else found

    def _learn(self, shard: int, name: str) -> None:
        """Read another member's range (its keys) in the background; deliveries wait for it."""
        if (shard, name) in self._learning:
            self._stale.add((shard, name))  # changed while being read: read it once more after
            return
        self._learning.add((shard, name))

        async def read() -> None:
            try:
                await self._read(shard, name)
            except CasqueError as error:
                # Not known until read: a record read before may be stale, and no watch is left
                # to say so (the one that fired is spent, the failed read set none).
                self._known.pop((shard, name), None)
                log.info("range %s of shard %s not read (%s); retried on the next receive", name, shard, error)
            finally:
                self._learning.discard((shard, name))
                self._member.notify()
            if (shard, name) in self._stale:
                self._stale.discard((shard, name))
                self._learn(shard, name)

        self._member.in_background(read())

    async def _read(self, shard: int, name: str) -> None:
        """Read a range with a watch: its holder rewrites its keys as they finish there
        (casque.engine.claim_reader), and the watch has it read again."""
        loop = asyncio.get_running_loop()

        def fired(event: WatchedEvent) -> None:  # kazoo's thread
            if self._active():
                call_soon_unless_closed(loop, self._changed, shard, name, event)

        record = await claims.read_claim(self.client, self.paths, shard, name, fired)
        names = self._names.get(shard)
        if record is None and names is not None:
            # Gone (completed). A listing answered after the watch's event can name a range
            # the watch already saw go: kept, it would wait to be read until the next event.
            names.discard(name)
        elif record is not None and name in (names or ()):
            self._known[(shard, name)] = record

    def _changed(self, shard: int, name: str, event: WatchedEvent) -> None:
        """A range read before changed (keys finished, renewed, taken over) or went, or its
        watch ended with the session (kazoo ends every watch of an expired session with an
        event of type NONE): then the record is forgotten and read again, watched anew."""
        if event.type in (EventType.DELETED, EventType.NONE):
            self._known.pop((shard, name), None)
            self._member.notify()
            return
        if name in self._held(shard):
            # Ours now (taken over): forgotten, so it is read afresh should it go elsewhere.
            self._known.pop((shard, name), None)
            return
        if event.type == EventType.CHANGED and ((shard, name) in self._known or (shard, name) in self._learning):
            # The record read before stays until the new one is read: a range's keys only
            # shrink, so the old set holds back at least what the new one does. A change
            # while the first read is under way may be newer than what it returns (its answer
            # reaches this loop after the event), and the watch it set has fired: read again.
            self._learn(shard, name)

    def watching(self, shard: int) -> bool:
        return shard in self._names

    def watch(self, shard: int) -> None:
        """Follow the shard's claims (names); ranges that went are forgotten, and receives woken."""
        self._names[shard] = None

        def changed(children: list[str], *_: object) -> None:
            present = set(children)
            self._names[shard] = present
            for key in [k for k in self._known if k[0] == shard and k[1] not in present]:
                del self._known[key]
            self._member.notify()  # a range completed: keys it held may be free

        ChildrenWatch(self.client, self.paths.claims(shard),
                      zk.watch_in_loop(asyncio.get_running_loop(), changed, self._active))

    async def see(self, shard: int) -> None:
        """Before delivering a new range with ordered keys: every range below it named.

        Listed after our claim or takeover was written, so it includes every range created
        before ours; a watch could still be catching up. The ranges not known yet are read
        in the background, all at once: until each is, keyed messages above it wait
        (`_foreign_keys`), so the range's other messages need not."""
        names = set(await claims.list_claims(self.client, self.paths, shard))
        self._names[shard] = names
        held = self._held(shard)
        for name in sorted(names - held):
            if (shard, name) not in self._known:
                self._learn(shard, name)
