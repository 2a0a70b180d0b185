"""A publish on its way to a shard writer: the messages of one call answered together
(`PublishCall`), each message waiting in its shard's pending list (`PendingPublish`), and
the id a retry took over from an intent whose writer can claim no more (`TakeOver`).

The publisher (casque.engine.publisher) makes them; its shard writers
(casque.engine.shard_writer) answer them once their batch is written, or fail them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime

from casque.engine.idempotency import IdempotencyGuard
from casque.engine.messages import OutgoingMessage, Published


class PublishCall:
    """The messages of one publish call that go straight to the log (those without a
    delivery time), answered together: one future for the call instead of one per message,
    which with its gathering cost about as much as the rest of a batch call's work on a
    message. The future is set once every message has its outcome, at its place in the call:
    where it was written, or the error that kept it out (so a call whose messages spanned
    shards or batches can say exactly which were written when a backend failed some).

    A message's outcome is set once: pending (None), then written (a Published) or failed
    (an exception). A caller that went away cancels the future; outcomes still land, for
    the idempotency guard.

    A message with a client id (or producer key) is tracked by the idempotency guard as
    this call's slot (`keys`, by index): a publish of the same id meanwhile waits on a
    future made for that slot alone (`watch`), and the guard hears when each slot lands
    (`IdempotencyGuard.slot_ended`), whatever became of the call."""

    __slots__ = ("future", "outcomes", "remaining", "guard", "keys", "started", "watchers")

    def __init__(self, future: asyncio.Future[list[Published | BaseException | None]], size: int,
                 guard: IdempotencyGuard) -> None:
        self.future = future
        self.outcomes: list[Published | BaseException | None] = [None] * size
        self.remaining = 0
        self.guard = guard
        self.keys: dict[int, str] | None = None
        # When its first id was tracked, before any intent of the call is written: what memory
        # keeps of its ids ends before their rows do.
        self.started = 0.0
        self.watchers: dict[int, asyncio.Future[Published]] | None = None

    def track(self, index: int, client_id: str) -> None:
        if self.keys is None:
            self.keys = {}
            self.started = time.monotonic()
        self.keys[index] = client_id
        self.guard.track_slot(client_id, self, index)

    def watch(self, index: int) -> asyncio.Future[Published]:
        """A future of the message at `index` alone (made for a publish of its id that waits)."""
        if self.watchers is None:
            self.watchers = {}
        watcher = self.watchers.get(index)
        if watcher is None:
            watcher = self.watchers[index] = self.future.get_loop().create_future()
        return watcher

    def resolve(self, index: int, result: Published) -> None:
        if self.outcomes[index] is not None:
            return  # answered already
        self.outcomes[index] = result
        self._ended(index, result, None)
        self._count_down()

    def fail(self, index: int, error: BaseException) -> None:
        if self.outcomes[index] is not None:
            return
        self.outcomes[index] = error
        self._ended(index, None, error)
        self._count_down()

    def _count_down(self) -> None:
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.outcomes)

    def _ended(self, index: int, result: Published | None, error: BaseException | None) -> None:
        if self.keys is not None and index in self.keys:
            self.guard.slot_ended(self.keys[index], self, index, result, self.started)
        if self.watchers is not None:
            watcher = self.watchers.pop(index, None)
            if watcher is not None and not watcher.done():
                if result is not None:
                    watcher.set_result(result)
                else:
                    watcher.set_exception(error or asyncio.CancelledError())


@dataclass
class PendingPublish:
    message_id: str
    message: OutgoingMessage
    # Its own future; or None, answered through `call` at `index`.
    future: asyncio.Future[Published] | None
    # Its client id is known not to be published (checked, or an intent settled): no check again.
    checked: bool = False
    # Set when this publish took its id over from an intent whose writer can claim no more.
    taken_over: TakeOver | None = None
    # The claim window its id check opened: (wall-clock deadline, monotonic end of claims).
    window: tuple[datetime, float] | None = None
    call: PublishCall | None = None
    index: int = 0

    def resolve(self, result: Published) -> None:
        if self.future is None:
            assert self.call is not None
            self.call.resolve(self.index, result)
        elif not self.future.done():
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if self.future is None:
            assert self.call is not None
            self.call.fail(self.index, error)
        elif not self.future.done():
            self.future.set_exception(error)


@dataclass
class TakeOver:
    """A publish that took its id over: its intent is recorded already, under `writer`, whose
    claims end at `claims_until` (monotonic). Its first claim is for `fence_batch` (if any),
    where a late claim of one of the `replaces` writers may land instead (see idempotency)."""

    writer: str
    claims_until: float
    fence_batch: int | None
    replaces: frozenset[str]
