"""Whose turn it is to claim a shard's fresh batches, in shared delivery.

Every member of a shared group watches every shard's head, so each new batch woke them all,
and all went after the same range from the same cursor: one claimed it and the others lost
the race, each having read the batches and sent a claim that failed. At a trickle that was
a lost race for every message at every other member, on the cores the winner needed.

So when few batches wait (no more than one claim takes whole), one member claims them at
once: the one picked for the shard and its head by a hash, the same at every member that
sees the same members, and spread over the members as heads move. The others leave them for
TURN_WAIT_SECONDS; if the batches are still unclaimed then, they claim them as before, and
treat that member as absent (its app asks for nothing, it is paused or gone) for
ABSENT_SECONDS, so an idle member costs the others one wait, not one per turn. A backlog of
more than a claim takes is claimed by all at once, as before.

Turns decide only who goes first. A claim is fenced by the cursor's version whoever sends
it (casque.engine.claims), so members that see different members, or a turn that runs out
while its member is claiming, cost a lost race, never a range claimed twice.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from casque.engine.claims import WHOLE_CLAIM_MESSAGES, Cursor

# How long the others leave a member's turn to it: a claim takes a few milliseconds, a
# loaded machine some tens.
TURN_WAIT_SECONDS = 0.05
ABSENT_SECONDS = 10.0


def turn_of(members: list[str], shard: int, head: int) -> str:
    """The member that claims first the batches of `shard` up to `head`."""
    ordered = sorted(members)
    return ordered[zlib.crc32(f"{shard}/{head}".encode()) % len(ordered)]


@dataclass(frozen=True)
class Wait:
    """Batches up to `head` left to `turn` until `until` (monotonic seconds)."""
    turn: str
    head: int
    until: float


class ClaimTurns:
    """One member's waits for the others' turns, and the members it found absent."""

    def __init__(self, member_id: str, members: Callable[[], list[str]], wake_after: Callable[[float], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.member_id = member_id
        self._members = members
        self._wake_after = wake_after
        self._clock = clock
        self._waits: dict[int, Wait] = {}
        self._absent_until: dict[str, float] = {}
        # Shards whose cursor as known here may be behind: this member held off while others claimed.
        self._stale: set[int] = set()
        # The head each shard had when this member last judged whose turn it was.
        self._judged_at: dict[int, int] = {}
        self.waits = 0
        self.absences = 0

    async def cursor_to_claim(self, shard: int, head: int, cursor: Cursor,
                              read_cursor: Callable[[], Awaitable[Cursor]]) -> Cursor | None:
        """The cursor to claim the shard's batches up to `head` from (read again if this member
        held off since it last read it), or None while another member's turn lasts."""
        last = self._judged_at.get(shard)
        self._judged_at[shard] = head
        if last is None or head > last + 1:
            # Heads this member never judged (a watch that reported two changes as one) may
            # have been other members' turns, claimed meanwhile.
            self._stale.add(shard)
        if self.hold_off(shard, head, cursor.next):
            self._stale.add(shard)
            return None
        if shard in self._stale:
            self._stale.discard(shard)
            cursor = await read_cursor()
            self.settle(shard, cursor.next)
        return cursor

    def hold_off(self, shard: int, head: int, cursor_next: int) -> bool:
        """Whether to leave the shard's batches from `cursor_next` (as last known here, maybe
        behind) up to `head` to another member for now. When a wait begins, `wake_after` is
        asked to look again once it has run out."""
        now = self._clock()
        wait = self._waits.get(shard)
        if wait is not None and now >= wait.until:
            return False  # its member had its time: claim (then `settle`)
        turn = self._turn(shard, head, cursor_next, now)
        if turn is None:
            self._waits.pop(shard, None)  # ours now, or everybody's: whatever was left is claimed with it
            return False
        if wait is None:
            # A wait keeps its first deadline while the head moves on: a run of absent
            # members' turns must not hold the batches back for ever.
            self._waits[shard] = Wait(turn, head, now + TURN_WAIT_SECONDS)
            self.waits += 1
            self._wake_after(TURN_WAIT_SECONDS)
        return True

    def settle(self, shard: int, cursor_next: int) -> None:
        """The shard's cursor, read after holding off: if a wait ran out with its batches still
        unclaimed, its member is absent for a while."""
        wait = self._waits.pop(shard, None)
        if wait is not None and self._clock() >= wait.until and cursor_next <= wait.head:
            self._absent_until[wait.turn] = self._clock() + ABSENT_SECONDS
            self.absences += 1

    def _turn(self, shard: int, head: int, cursor_next: int, now: float) -> str | None:
        """The other member whose turn it is, or None if this one may claim at once."""
        if head - cursor_next >= WHOLE_CLAIM_MESSAGES:
            return None  # more than one claim takes: a backlog for all
        members = self._members()
        if self.member_id not in members or len(members) < 2:
            return None
        turn = turn_of(members, shard, head)
        if turn == self.member_id or self._absent_until.get(turn, float("-inf")) > now:
            return None
        return turn
