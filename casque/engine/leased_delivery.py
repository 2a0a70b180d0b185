"""Leased delivery: the readers of the shards this member holds leases on, started and
stopped by the lease recipe's callbacks (casque.engine.leases).

A shard acquired gets a reader from its offset as of the subscriber's seek mark; a shard
released is handed over first (ShardReader.hand_over: no new deliveries, the lease goes
once what is in flight is settled or invisible no longer), then stopped with its acks and
offset flushed; a session lost drops every reader at once without writing (another member
may hold the shards already); a commit that finds the fence moved drops its shard. A seek
restarts the readers of the shards it moved, each from its new epoch.
"""

from __future__ import annotations

import asyncio
import logging

from casque.engine import claims, offsets
from casque.engine.claim_reader import SKEW_MARGIN_SECONDS
from casque.engine.clock import clock_of
from casque.engine.leases import ShardLeases
from casque.engine.member import LeasedReader, Member, ShardStatus
from casque.engine.shard_reader import ShardReader

log = logging.getLogger(__name__)


class LeasedDelivery:
    def __init__(self, member: Member) -> None:
        self._member = member
        self.readers: dict[int, ShardReader] = {}
        # The wall clock claims are written in (casque.engine.sharing): Cassandra's.
        self._clock = clock_of(member.store.session)

    async def acquired(self, shard: int, fence: int) -> None:
        # Claims of members still in shared delivery (a switch of modes under way) end first:
        # the offset and ack rows read after cannot miss an ack they answered (claims.py).
        ended = await claims.end_sharing(self._member.store.zk, self._member.paths, shard, self._clock.ms,
                                         int(SKEW_MARGIN_SECONDS * 1000))
        if ended:
            log.warning("shard %s: ended %d claim(s) of members in shared delivery before reading it", shard, ended)
        mark = await offsets.read_seek_mark(self._member.store.zk, self._member.paths)
        record = await offsets.read_offset(self._member.store.zk, self._member.paths, shard)
        record = await self._up_to_checkpoint(shard, fence, record)
        reader = ShardReader(self._member, shard, record, fence, mark)
        earlier = self.readers.get(shard)
        self.readers[shard] = reader
        reader.start()
        if earlier is not None:
            # An acquisition over a reader of an earlier one that nothing stopped (its lease
            # forgotten without it): that reader's fence is stale; it must not run on unowned.
            self._member.in_background(earlier.stop(flush=False))

    async def _up_to_checkpoint(self, shard: int, fence: int, record: offsets.OffsetRecord) -> offsets.OffsetRecord:
        """The shard's offset, moved up to its checkpoint in Cassandra if ZooKeeper holds an
        older one (restored from a snapshot): what was done is not delivered again. Under the
        lease's fence, as any commit; a checkpoint that cannot be read leaves the offset as
        it is (the ack rows still skip what was acked)."""
        member = self._member
        checkpoints = member.checkpoints
        if checkpoints is None:
            return record
        try:
            found = await checkpoints.read(shard)
        except Exception as error:  # every driver error: see above
            log.info("shard %s: offset checkpoint not read (%r)", shard, error)
            return record
        if found is None or found.order <= (record.epoch, record.offset):
            return record
        outcome, version = await offsets.commit_offset(member.store.zk, member.paths, shard, found.batch, found.epoch,
                                                       record.version, fence)
        if outcome is not offsets.CommitOutcome.WRITTEN:
            return record  # a seek or another holder came first: the reader learns it as always
        member.counters.offsets_rebuilt += 1
        log.warning("shard %s: offset %d@%d in ZooKeeper was behind its checkpoint; moved up to %d@%d", shard,
                    record.offset, record.epoch, found.batch, found.epoch)
        return offsets.OffsetRecord(found.batch, found.epoch, version)

    async def released(self, shard: int, fence: int) -> None:
        """Hand over and stop the reader of the acquisition `fence` of `shard` (none if the
        session was lost meanwhile: a reader of a later acquisition is not this release's)."""
        reader = self.readers.get(shard)
        if reader is None or reader.fence != fence:
            return
        if not self._member.stopping:
            # A rebalance moves the shard: let the app finish what it holds from it first
            # (a stopping consumer has had its drain time already).
            await reader.hand_over()
        if self.readers.get(shard) is reader:
            del self.readers[shard]
        await reader.stop(flush=True)

    async def lost(self) -> None:
        readers, self.readers = self.readers, {}
        await asyncio.gather(*(reader.stop(flush=False) for reader in readers.values()))

    def lease_lost(self, reader: LeasedReader) -> None:
        """A commit found the shard's fence moved: drop the shard; the leases rebalance."""
        self._member.counters.leases_lost += 1
        log.warning("shard %s: another member acquired it; dropping it", reader.shard)
        if self.readers.get(reader.shard) is reader:
            del self.readers[reader.shard]
        leases = self._member.leases
        if leases is not None and leases.held.get(reader.shard) == reader.fence:
            leases.forget(reader.shard)
        self._member.in_background(reader.stop(flush=False))

    async def resync(self) -> None:
        """Restart the readers of the shards a seek moved to a new epoch."""
        mark = await offsets.read_seek_mark(self._member.store.zk, self._member.paths)
        for shard, reader in sorted(self.readers.items()):
            record = await offsets.read_offset(self._member.store.zk, self._member.paths, shard)
            if record.epoch == reader.epoch:
                reader.seek_mark = mark  # read after the mark, and unmoved: current as of it
                continue
            if not reader.current:
                continue
            await reader.stop(flush=False)
            leases = self._member.leases
            fence = leases.held.get(shard) if leases is not None else None
            if self.readers.get(shard) is not reader or fence != reader.fence:
                continue  # released or lost meanwhile: the lease callbacks own the shard now
            fresh = ShardReader(self._member, shard, record, reader.fence, mark)
            self.readers[shard] = fresh
            fresh.start()
            self._member.counters.seeks_applied += 1

    async def status(self, leases: ShardLeases, held: list[int]) -> ShardStatus:
        """The shards due to this member that it does not read, and those it reads that fail;
        or, while the session is not known alive, that nothing is handed out."""
        if not leases.trusted:
            return ShardStatus(held, problem=f"ZooKeeper has not confirmed this member's session "
                                             f"{leases.trust.unconfirmed}: handing out nothing until it does")
        due = await leases.assigned()
        if due is None:
            return ShardStatus(held, problem="not in the group: registering")
        missing = sorted(due - set(self.readers))
        failing = {s: r.problem for s, r in sorted(self.readers.items()) if r.problem}
        problems = []
        if missing:
            why = f" ({leases.last_error})" if leases.last_error else ""
            problems.append(f"waiting for leases on shards {missing}{why}")
        problems.extend(f"shard {s}: {problem}" for s, problem in failing.items())
        return ShardStatus(held, missing, failing, "; ".join(problems))
