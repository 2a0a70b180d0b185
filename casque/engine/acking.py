"""Acks answered only when durable: the member's side of the ack state machine.

A delivery an ack names goes in flight -> acking (ShardState.start_ack) at once; the call
writes the acks' rows (AckLog: insert-only, group-committed) and then confirms each source
is still this member's: a leased shard's lease (proven locally while the session is trusted,
else read from ZooKeeper) or a claimed range's claim version. Only then is the delivery done
(`finish_ack`: its batch may complete and its key move on) and the ack answered. A failed
write or check puts it back in flight as it was (`abort_ack`), and the ack is answered with
the error: the receipt stays valid until its visibility ends. An ack of the same receipt
that arrives while one is being recorded waits for it and gets its answer (`already_acked`
on success). A new holder reads the ack rows only after it takes the lease or claim, so a
row written before the confirmation is always seen.

Seeks are looked for alongside the writes (one read of the subscriber's seek mark): a
member learns of a seek through a watch, after the seek is answered, so an ack of a delivery
from the old epoch is answered `stale_receipt` (the seek replays or skips it), never `acked`.
Ack calls side by side share that read (`FreshRead`), each answered by one sent after it
began, so an app acking one message at a time from many workers costs one ZooKeeper round
trip per read in flight, not one per ack.

An ack whose source this member no longer holds (the shard moved on, the range completed)
is an app resending one whose answer it lost, or acking late. A resend of an ack this member
answered `acked` (it remembers the last RECENT_ACKS) is answered `already_acked`, as the app
expects of a resend; anything else is `stale_receipt`. An ack row alone would not do: a row
whose lease check failed (answered `lease_lost`) may have landed after the next holder read
the rows, and that holder delivers the message again.

An ack whose row may have been written but that was not answered `acked` (the write or the
check failed: a 503 or `lease_lost`) may still count: whoever reads the range's ack rows next,
this member after its session ended or another, finds the row and never delivers the message
again. The client retries a 503; if the retry finds the source gone, `stale_receipt` would say
the ack certainly did nothing. So such a retry is answered `lease_lost` (the ack may have been
recorded, the message may come again) for the last RECENT_ACKS of them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from casque.engine import offsets
from casque.engine.acks import ACK, AckEvent
from casque.engine.claim_reader import ClaimReader
from casque.engine.member import Member
from casque.engine.messages import Position, decode_receipt
from casque.engine.shard_reader import ShardReader
from casque.engine.entries import AckStart
from casque.errors import BackendUnavailable, CasqueError, LeaseLost, StaleReceipt

# Where a delivery comes from: a leased shard's reader, or a claimed range (shared delivery).
Source = ShardReader | ClaimReader
# Finds a receipt's source, position and nonce; StaleReceipt if this member does not hold it.
SourceOfReceipt = Callable[[str], tuple[Source, Position, int]]
# An ack a call started: its index in the call's results, its source, its event, its nonce.
_Acking = tuple[int, Source, AckEvent, int]
T = TypeVar("T")


async def each_settled(calls: list[Awaitable[T]]) -> list[T | BaseException]:
    """Each call's result or its error, as `gather(return_exceptions=True)` gives them; one
    call is awaited in this task rather than in a task of its own."""
    if len(calls) == 1:
        try:
            return [await calls[0]]
        except Exception as error:
            return [error]
    return await asyncio.gather(*calls, return_exceptions=True)


class FreshRead(Generic[T]):
    """One read shared by concurrent callers, each answered by a read that began after it asked.

    A caller needs what the store says now, after it asked: a read already under way may
    have been sent before that, so a caller never joins it but waits for the next one, which
    starts when that one ends. At most one read is in flight; every caller that arrives
    meanwhile shares the next.
    """

    def __init__(self, read: Callable[[], Awaitable[T]]) -> None:
        self._read = read
        self._next: asyncio.Future[T] | None = None
        self._task: asyncio.Task[None] | None = None

    async def get(self) -> T:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            # Nobody may be left to read a failure (every caller cancelled): never logged as lost.
            self._next.add_done_callback(lambda done: done.cancelled() or done.exception())
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(self._run())
        return await asyncio.shield(self._next)

    async def _run(self) -> None:
        try:
            while self._next is not None:
                waiting, self._next = self._next, None
                try:
                    waiting.set_result(await self._read())
                except Exception as error:
                    waiting.set_exception(error)
                except BaseException:
                    waiting.cancel()
                    raise
        finally:
            self._task = None
            if self._next is not None:  # stopped (cancelled) with callers waiting for a next read
                self._next.cancel()
                self._next = None


# Acks answered `acked` remembered for resends after their source left (about 2 MiB).
RECENT_ACKS = 8192


class NotHeldHere(StaleReceipt):
    """No source of this member holds the receipt's position (any more)."""

    def __init__(self, message: str, position: Position, nonce: int) -> None:
        super().__init__(message)
        self.key = (position.shard, position.batch, position.seq, nonce)


def seek_overtook(reader: Source) -> StaleReceipt:
    """The answer to an ack of a delivery whose shard a seek moved before this member applied it."""
    return StaleReceipt(f"a seek moved shard {reader.shard} after this delivery; it is replayed from the new position")


class AckTaker:
    def __init__(self, member: Member, source_of: SourceOfReceipt) -> None:
        self._member = member
        self._source_of = source_of
        # Acks being made durable, by (shard, batch, seq, nonce): a resent ack shares the answer.
        self._acking: dict[tuple[int, int, int, int], asyncio.Future[bool | CasqueError]] = {}
        self._seek_mark = FreshRead(lambda: offsets.read_seek_mark(member.store.zk, member.paths))
        # Deliveries whose ack this member answered `acked`, oldest first (see RECENT_ACKS).
        self._acked: OrderedDict[tuple[int, int, int, int], None] = OrderedDict()
        # Deliveries whose ack row may have been written though the ack failed (see the module's docstring).
        self._maybe_recorded: OrderedDict[tuple[int, int, int, int], None] = OrderedDict()

    async def ack_many(self, receipts: list[str]) -> list[bool | CasqueError]:
        """Acknowledge several deliveries at once; one result (or error) per receipt, in order.

        An ack is answered only once it is durable: its ack row is written and the source's
        lease (or claim) is confirmed still ours afterwards (a next holder reads the rows only
        after it takes the lease, so it sees the row). Until then the delivery is ACKING (see
        ShardState.start_ack): still in flight, its key still held. True: this call acked it.
        False: it was acked before (durably), or an ack of it that is being recorded now
        succeeded; a resent ack that arrives meanwhile waits for that one and gets its answer.
        An error: nothing changed; the receipt stays valid until its visibility ends.
        """
        results: list[bool | CasqueError] = [False] * len(receipts)
        started: list[_Acking] = []
        joined: list[tuple[int, asyncio.Future[bool | CasqueError]]] = []
        elsewhere: list[tuple[int, NotHeldHere]] = []
        acking = self._acking
        for index, receipt in enumerate(receipts):
            try:
                reader, position, nonce = self._source_of(receipt)
                start = reader.state.start_ack(position, nonce)
            except NotHeldHere as moved:
                elsewhere.append((index, moved))
                continue
            except StaleReceipt as stale:
                results[index] = self._maybe_recorded_answer(decode_key(receipt), stale)
                continue
            except CasqueError as error:
                results[index] = error
                continue
            key = (position.shard, position.batch, position.seq, nonce)
            if start is AckStart.STARTED:
                acking[key] = asyncio.get_running_loop().create_future()
                event = AckEvent(reader.epoch, reader.shard, position.batch, position.seq, outcome=ACK)
                started.append((index, reader, event, nonce))
            elif start is AckStart.PENDING:
                joined.append((index, acking[key]))
        if started:
            try:
                outcomes = await self._make_durable(started)
            except BaseException:
                # Cancelled (a shutdown): nothing is answered, so put every delivery back in flight.
                for _, reader, event, nonce in started:
                    reader.state.abort_ack(Position(event.shard, event.batch, event.seq), nonce)
                    future = acking.pop((event.shard, event.batch, event.seq, nonce), None)
                    if future is not None and not future.done():
                        future.set_result(BackendUnavailable("the ack was interrupted; send it again"))
                raise
            for (index, reader, event, nonce), outcome in zip(started, outcomes):
                results[index] = outcome
                if outcome is True:
                    _remember(self._acked, (event.shard, event.batch, event.seq, nonce))
                elif not isinstance(outcome, StaleReceipt) or isinstance(outcome, LeaseLost):
                    # Its row may be written (a seek's stale answer is final: the seek replays it).
                    _remember(self._maybe_recorded, (event.shard, event.batch, event.seq, nonce))
                future = acking.pop((event.shard, event.batch, event.seq, nonce), None)
                if future is not None and not future.done():
                    # What a resend of this delivery's ack hears: done already, or the same error.
                    future.set_result(False if outcome is True else outcome)
        for index, shared in joined:
            results[index] = await asyncio.shield(shared)
        for index, gone in elsewhere:
            # False: already acked
            results[index] = False if gone.key in self._acked else self._maybe_recorded_answer(gone.key, gone)
        return results

    def _maybe_recorded_answer(self, key: tuple[int, int, int, int], stale: StaleReceipt) -> StaleReceipt:
        if key not in self._maybe_recorded:
            return stale
        return LeaseLost(f"message {key[0]}/{key[1]}/{key[2]}: an earlier try of this ack may have been recorded "
                         "before its batches moved on; the message may be delivered again")

    async def _make_durable(self, started: list[_Acking]) -> list[bool | CasqueError]:
        """Write the ack rows of `started`, confirm their sources, and move each delivery to
        done (True), or back to in flight with the reason it is not acked (an error)."""
        readers = list({r for _, r, _, _ in started})
        # Seeks are looked for alongside (see seek_overtook). One task for it and the rest in
        # this one: every ack call comes here, and a task or a gather per step was a
        # measurable share of a one-message ack's CPU.
        seeks = asyncio.get_running_loop().create_task(self._moved_by_seeks(set(readers)))
        rows: list[bool | BaseException] | BaseException
        moved: set[Source] | BaseException
        try:
            await self._member.acks.record_many([e for _, _, e, _ in started])
            rows = await each_settled([r.still_leased() for r in readers])
        except asyncio.CancelledError:
            seeks.cancel()
            raise
        except Exception as unwritten:
            rows = unwritten
        try:
            moved = await seeks  # only this task's own cancellation cancels it: that propagates
        except Exception as unchecked:
            moved = unchecked
        failure = next((o for o in (rows, moved) if isinstance(o, BaseException)), None)
        outcomes: list[bool | CasqueError] = []
        if failure is not None:
            if not isinstance(failure, Exception):
                raise failure  # cancelled: the deliveries stay ACKING only until the finally below
            error = failure if isinstance(failure, CasqueError) else BackendUnavailable(
                f"acks not recorded: {failure!r}")
            for _, reader, event, nonce in started:
                reader.state.abort_ack(Position(event.shard, event.batch, event.seq), nonce)
            return [error] * len(started)
        assert isinstance(rows, list) and isinstance(moved, set)
        held = dict(zip(readers, rows))
        for _, reader, event, nonce in started:
            position = Position(event.shard, event.batch, event.seq)
            verdict = held[reader]
            if verdict is not True:
                reader.state.abort_ack(position, nonce)
                if isinstance(verdict, CasqueError):
                    outcomes.append(verdict)
                elif isinstance(verdict, BaseException):
                    outcomes.append(BackendUnavailable(f"lease not confirmed: {verdict!r}"))
                else:
                    what = "its batches" if isinstance(reader, ClaimReader) else "shard"
                    outcomes.append(LeaseLost(f"{what} {reader.shard} moved to another member before the ack was "
                                              "recorded; the message may be delivered again"))
                continue
            reader.state.finish_ack(position, nonce)
            self._member.counters.acks += 1
            outcomes.append(seek_overtook(reader) if reader in moved else True)
        for reader in readers:
            reader.schedule_commit()
            reader.space_freed()
        return outcomes

    async def _moved_by_seeks(self, sources: set[Source]) -> set[Source]:
        """The sources whose shard a seek has moved to another epoch than theirs, as ZooKeeper tells it now.

        One read of the seek mark answers for every source whose epoch was read after a
        mark that is still current; only the others read their shard's offset znode (a
        claimed range, or a reader after a seek it has not checked against yet).
        """
        zk_client = self._member.store.zk

        async def epochs(shards: set[int]) -> dict[int, int]:
            records = await asyncio.gather(*(offsets.read_offset(zk_client, self._member.paths, s) for s in shards))
            return {shard: record.epoch for shard, record in zip(shards, records)}

        marked = {s for s in sources if s.seek_mark is not None}
        epoch_of: dict[int, int] = {}
        if marked:
            unmarked = {s.shard for s in sources - marked}
            if unmarked:
                mark, epoch_of = await asyncio.gather(self._seek_mark.get(), epochs(unmarked))
            else:  # the usual case: the seek mark answers for every source
                mark = await self._seek_mark.get()
            unsure = {s.shard for s in marked if s.seek_mark != mark}
            if unsure:
                epoch_of.update(await epochs(unsure))
        elif sources:
            epoch_of = await epochs({s.shard for s in sources})
        return {s for s in sources if s.shard in epoch_of and epoch_of[s.shard] != s.epoch}


def _remember(keys: OrderedDict[tuple[int, int, int, int], None], key: tuple[int, int, int, int]) -> None:
    keys[key] = None
    keys.move_to_end(key)
    if len(keys) > RECENT_ACKS:
        keys.popitem(last=False)


def decode_key(receipt: str) -> tuple[int, int, int, int]:
    position, nonce = decode_receipt(receipt)
    return position.shard, position.batch, position.seq, nonce
