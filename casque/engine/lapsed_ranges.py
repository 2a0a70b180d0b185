"""Which ranges of a shared subscriber's shard a member may take over, and taking them.

A range is taken over once its claim's time has run out (plus the skew margin), or before
that once the member that wrote it has left the group (casque.engine.claims.departed). A
member whose app asks for nothing takes over only a range whose `wake` has come (a message
in it is due for the dead-letter queue), so dead letters move on time without a receive.
Claims of an earlier seek epoch are moot and deleted on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

from casque.engine import claims
from casque.engine.claim_reader import SKEW_MARGIN_SECONDS, RangeKeeper, registration_of, session_of
from casque.engine.claims import ClaimRecord, Cursor


class SeekAhead(Exception):
    """The shard has a claim of a later seek epoch than the cursor read: read the cursor again."""


@dataclass(frozen=True)
class Taken:
    record: ClaimRecord  # as this member rewrote it
    registration: int  # the member's registration before the rewrite (casque.engine.claim_reader)
    previous: ClaimRecord  # as it was: whose it was, and until when
    why: str


class LapsedRanges:
    """The other members' claims of each shard as last read, and their takeover."""

    def __init__(self, keeper: RangeKeeper) -> None:
        self._keeper = keeper
        # The latest claim records of other members seen, by (shard, name): re-read only once lapsed.
        self._seen: dict[tuple[int, str], ClaimRecord] = {}

    async def take_over(self, shard: int, cursor: Cursor, held: set[str], until_ms: int,
                        woken_only: bool) -> Taken | None:
        """The first range of `shard` that may be taken over, rewritten as this member's until
        `until_ms`; None if there is none (or others were faster). `held`: names of this
        member's own claims. Raises SeekAhead."""
        keeper = self._keeper
        member = keeper.consumer
        names = await claims.list_claims(keeper.client, keeper.paths, shard)
        present = set(names)
        for key in [k for k in self._seen if k[0] == shard and k[1] not in present]:
            del self._seen[key]
        members = set(member.group_members())
        for name in names:
            epoch = int(name.partition("-")[0])
            if epoch < cursor.epoch:
                await claims.delete_claim(keeper.client, keeper.paths, shard, name)  # moot since a seek
                continue
            if epoch > cursor.epoch:
                raise SeekAhead(name)
            if name in held:
                continue
            seen = self._seen.get((shard, name))
            lapsed_at = keeper.clock.ms() - int(SKEW_MARGIN_SECONDS * 1000)
            if seen is not None and seen.until_ms > lapsed_at and seen.member in members:
                continue
            record = await claims.read_claim(keeper.client, keeper.paths, shard, name)
            if record is None:
                continue
            self._seen[(shard, name)] = record
            # A claim is taken before its time once the member that wrote it has left the
            # group: read before its member znode is, so that a rewrite by a member that came
            # back (and may hand out again) makes the takeover's compare-and-set fail.
            if record.until_ms > lapsed_at and (
                    record.member in members or not await claims.departed(keeper.client, keeper.paths, record)):
                continue
            if woken_only and not 0 < record.wake_ms <= keeper.clock.ms():
                continue
            why = "its time ran out" if record.until_ms <= lapsed_at else "its member left the group"
            if woken_only:
                why += "; a message in it is due for the dead-letter queue"
            registration = registration_of(member)
            taken = await claims.rewrite(keeper.client, keeper.paths, record, member.member_id, until_ms,
                                         session=session_of(member))
            keeper.zk_writes += 1
            if taken is not None:
                return Taken(taken, registration, record, why)
            # another member was faster
        return None
