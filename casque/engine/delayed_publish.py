"""The way of a message with a delivery time into the queue: stored in the delayed table
and moved into the log by the mover (casque.engine.delayed), or moved by its own publisher
when the mover has passed its due time already; with a client id, through the states of
`DelayedPublish`, so that a retry stores and moves it once.

The publisher (casque.engine.publisher.Publisher) hands such messages to its `DelayedRoute`
and gives it the two ways into the log it needs: a publish, and a hand-over to a shard writer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import datetime

from kazoo.exceptions import KazooException
from kazoo.recipe.watchers import DataWatch

from casque.backends import zk
from casque.engine.clock import BackendClock
from casque.engine.counters import DELAYED_OUT
from casque.engine.delayed import (
    IMMEDIATE_SECONDS,
    PASS_SECONDS,
    CursorReads,
    DelayedStore,
    moved_message,
    read_cursor,
    stored_due,
)
from casque.engine.idempotency import IdempotencyGuard
from casque.engine.messages import OutgoingMessage, Published
from casque.errors import BackendUnavailable, CasqueError
from casque.schema import QueueRef
from casque.specs import QueueState
from casque.store import Store

log = logging.getLogger(__name__)

# What a delayed row's check against the mover's cursor may meet, and retry.
_CHECK_FAILURES = (CasqueError, asyncio.TimeoutError, KazooException)
# A delayed publish waits this long at most for its check (a fresh cursor read takes up to
# CURSOR_READ_SECONDS; a ZooKeeper client cut off reconnects within its session), trying
# again this often; past it, the publish fails as retryable.
CHECK_SECONDS = 15.0
CHECK_RETRY_SECONDS = 0.5
# A writer that finds the mover's pass over its row's due time waits this long at most for the
# pass to be done (a pass starts at least every PASS_SECONDS), reading the cursor this often.
MOVER_PASS_WAIT_SECONDS = 4 * PASS_SECONDS
MOVER_PASS_POLL_SECONDS = 0.05


class DelayedPublish:
    """The states of a delayed publish with an id (a client id or a producer key) on its
    way to the log (`DelayedRoute.route`), and what a retry of the id does in each: whatever
    fails in between, the message is stored once, and moved into the log once.

    A delayed message's id carries its due time, and its row is stored at exactly that time
    (`delayed.due_and_id`), so the id alone finds the row again (`delayed.stored_due`).
    """

    NEW = "NEW"
    """Nothing holds the id. A retry publishes it as a first attempt, under a new message id:
    no row was stored either (the record comes first)."""

    RECORDED = "RECORDED"
    """The id's record names the message id, as a delayed message (shard, batch and seq -1);
    the row may not be stored yet. A record written before its row, not after: a row stored
    (or applied unanswered) with no record was found by nobody, and the retry stored a
    second message. A retry, through any sidecar, stores the row again at the due time the
    id carries (the same row), checks it against the mover, and answers the first publish,
    `duplicate: true` (`DelayedRoute._keep`). A record write that failed may have been
    applied or not: the retry finds RECORDED or NEW, one message either way."""

    STORED = "STORED"
    """The row is in `delayed` and counted in (`delayed_in`; a count that failed leaves the
    retry to answer, uncounted: counts are statistics). The mover may have passed its due
    time before the row landed, so the publish is not answered yet."""

    CHECKED = "CHECKED"
    """The mover's cursor was read after the row landed: the mover will read the row, or this
    writer moved it (`DelayedRoute._move_if_passed`). Answered now; any failure before this
    is answered 503, and the retry completes the publish from RECORDED."""

    MOVED = "MOVED"
    """In the log under the client id `delayed/<message id>`: moved twice (the mover and the
    writer, a failover, a retry's check), it is stored once."""


class DelayedRoute:
    """Routes one publisher's messages that have a delivery time. `publish` publishes with
    given message ids (a move into the log); `to_log` hands one message to its shard writer."""

    def __init__(self, store: Store, queue: QueueRef, state: QueueState, clock: BackendClock,
                 idempotency: IdempotencyGuard,
                 publish: Callable[[Sequence[OutgoingMessage], Sequence[str]], Awaitable[list[Published]]],
                 to_log: Callable[[OutgoingMessage, str], Awaitable[Published]]) -> None:
        self._store = store
        self._queue = queue
        self._state = state
        self._clock = clock
        self._idempotency = idempotency
        self._publish = publish
        self._to_log = to_log
        self._delayed: DelayedStore | None = None
        self._cursor_reads: CursorReads | None = None
        # The mover's `until` as its znode's watch last told.
        self._mover_cursor: datetime | None = None
        # Delayed rows moved into the log here, the mover having passed them without moving
        # them (see _move_if_passed); a move the mover had made already is not counted.
        self.moves = 0

    async def route(self, message: OutgoingMessage, message_id: str, due: datetime) -> Published:
        """A message with a delivery time: into the delayed table, or into the log if due
        already. With an id, through the states of DelayedPublish."""
        if message.client_id:
            earlier = await self._idempotency.earlier(message.client_id)
            if earlier is not None:
                if earlier.batch >= 0:
                    return earlier
                return await self._keep(earlier, due, message)  # RECORDED, by an attempt before
        if not self.is_later(due):
            return await self._to_log(message, message_id)
        result = Published(message_id, -1, -1, -1, deliver_at=due)
        state = DelayedPublish.NEW
        try:
            if message.client_id:
                # Before the row: whatever fails from here on, a retry finds the message id.
                await self._idempotency.record_positions([(message, result)])
                state = DelayedPublish.RECORDED
            await self._delayed_table().insert(message_id, due, message)
            state = DelayedPublish.STORED
            await self._move_if_passed(message_id, due, message)
        except Exception as error:
            if message.client_id:
                log.info("queue %s: delayed message %s failed after %s (%s): a retry with its id stores it once",
                         self._queue, message_id, state, error)
            raise
        return result

    async def _keep(self, earlier: Published, due: datetime, message: OutgoingMessage) -> Published:
        """A retry of a delayed publish whose id an attempt before recorded (RECORDED): that
        attempt may have failed before its row was stored, or after (its write unanswered,
        its count or its check against the mover failed, its process gone), so its row may be
        missing or lie behind the mover, unread. The row is stored again under the recorded
        message id at the due time that id carries: the same row, whatever this retry's own
        delay says. Then it is checked, or moved now if due; both moves are under one client
        id, so the message is stored once. Not counted in again. Answered as the first
        publish, with its due time."""
        due = stored_due(earlier.message_id, due)
        if self.is_later(due):
            await self._delayed_table().insert(earlier.message_id, due, message, count=False)
            await self._move_if_passed(earlier.message_id, due, message)
        else:
            await self._move_now(earlier.message_id, message)
        return replace(earlier, deliver_at=due)

    def is_later(self, due: datetime) -> bool:
        """Whether a message due at `due` waits in the delayed table (else: straight into the log)."""
        now = self._clock.now()
        if (due - now).total_seconds() <= IMMEDIATE_SECONDS:
            return False
        # The mover has read up to its cursor (our clock may lag its): a row due before that
        # is due now. (Its watch may lag too; `_move_if_passed` settles what it missed.)
        cursor = self._mover_cursor
        return cursor is None or due > cursor

    async def _move_if_passed(self, message_id: str, due: datetime, message: OutgoingMessage) -> None:
        """After a delayed row is written, before the publish is answered: if the mover has
        started a pass that reads rows due by `due`, that pass may have read before the row
        landed, so the row is moved now, with the mover's client id for it (both moves store
        one message). Otherwise every pass that reads it starts after it landed.

        The publish is answered only once this is done: a check left to the background was
        lost with its process (kill -9), and the row behind the mover with it. If ZooKeeper
        does not answer within CHECK_SECONDS the publish fails as retryable; its row is
        stored, and a retry (same client id) stores and checks it again (`_keep`)."""
        deadline = asyncio.get_running_loop().time() + CHECK_SECONDS
        while True:
            try:
                await self._check_and_move(message_id, due, message)
                return
            except _CHECK_FAILURES as error:
                if asyncio.get_running_loop().time() >= deadline:
                    raise BackendUnavailable(
                        f"delayed message {message_id} is stored but could not be checked against the "
                        f"mover's cursor ({type(error).__name__}: {error}); publish it again") from error
                log.info("queue %s: delayed message %s not checked against the mover's cursor yet (%s)",
                         self._queue, message_id, error)
            await asyncio.sleep(CHECK_RETRY_SECONDS)

    async def _check_and_move(self, message_id: str, due: datetime, message: OutgoingMessage) -> None:
        assert self._cursor_reads is not None
        cursor = await self._cursor_reads.read()
        if cursor is None or cursor.until < due:
            return  # every pass that reads the row starts after it landed
        # A pass that reads rows due by `due` has started: it read before the row landed, or it
        # read the row and is moving it. Both moves carry one client id, but two first
        # attempts of an id at once may both publish (casque.engine.idempotency), so this one
        # waits for that pass to be done (`moved` reaches `due`): then it is a retry of the
        # mover's move, answered from its record, or the only move. A mover that does not get
        # there in time (gone, cut off) is not waited for longer.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MOVER_PASS_WAIT_SECONDS
        while cursor is not None and cursor.moved < due and loop.time() < deadline:
            await asyncio.sleep(MOVER_PASS_POLL_SECONDS)
            cursor = await self._cursor_reads.read()
        await self._move_now(message_id, message)

    async def _move_now(self, message_id: str, message: OutgoingMessage) -> None:
        moved_now = moved_message(message_id, message, self._state.spec.retention_seconds)
        (moved,) = await self._publish([moved_now], [message_id])
        if not moved.duplicate:
            self.moves += 1
            await self._delayed_table().counters.add(DELAYED_OUT, 1)

    def _delayed_table(self) -> DelayedStore:
        if self._delayed is None:
            self._delayed = DelayedStore(self._store, self._state.shared_key(self._queue),
                                         self._state.spec.retention_seconds)
            self._cursor_reads = CursorReads(self._store, self._store.paths(self._queue).mover)
            loop = asyncio.get_running_loop()
            DataWatch(self._store.zk, self._store.paths(self._queue).mover,
                      zk.watch_in_loop(loop, self._cursor_changed, lambda: True))
        return self._delayed

    def _cursor_changed(self, data: bytes | None, *_: object) -> None:
        try:
            cursor = read_cursor(data)
        except (ValueError, KeyError):
            cursor = None
        self._mover_cursor = None if cursor is None else cursor.until
