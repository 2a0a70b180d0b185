"""A publish call's outcomes (casque.engine.pending.PublishCall): answered once every message
has one, and a call part of which failed says which part."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from casque.engine.messages import Published
from casque.engine.pending import PublishCall
from casque.engine.publisher import written_whole
from casque.errors import BackendUnavailable, PartiallyPublished, PublishOutcomeUnknown


class NoGuard:
    """The idempotency guard's part a call without ids never calls."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"guard.{name} called for a call without ids")


def place(seq: int) -> Published:
    return Published(f"id-{seq}", 0, 1, seq)


async def test_a_call_is_answered_once_every_message_has_an_outcome_even_after_a_failure() -> None:
    call = PublishCall(asyncio.get_running_loop().create_future(), 3, NoGuard())  # type: ignore[arg-type]
    call.remaining = 3
    failure = BackendUnavailable("shard 1 refused")
    call.fail(1, failure)
    assert not call.future.done()  # the other shards' writes are still out
    call.resolve(0, place(0))
    call.fail(1, BackendUnavailable("again"))  # an outcome is set once
    call.resolve(2, place(2))
    assert call.future.result() == [place(0), failure, place(2)]


async def test_a_call_whose_caller_left_still_takes_its_outcomes() -> None:
    call = PublishCall(asyncio.get_running_loop().create_future(), 2, NoGuard())  # type: ignore[arg-type]
    call.remaining = 2
    call.future.cancel()
    call.resolve(0, place(0))
    call.resolve(1, place(1))
    assert call.outcomes == [place(0), place(1)] and call.remaining == 0


def test_every_message_written_is_the_results() -> None:
    assert written_whole([place(0), place(1)]) == [place(0), place(1)]


def test_no_message_written_is_the_first_error() -> None:
    first, second = BackendUnavailable("a"), PublishOutcomeUnknown("b")
    with pytest.raises(BackendUnavailable) as raised:
        written_whole([first, second])
    assert raised.value is first


def test_part_written_names_each_message_not_written() -> None:
    unknown = PublishOutcomeUnknown("may have been written")
    outcomes: list[Published | BaseException | None] = [place(0), BackendUnavailable("no"), place(1), unknown]
    with pytest.raises(PartiallyPublished) as raised:
        written_whole(outcomes)
    partial = raised.value
    assert isinstance(partial, BackendUnavailable) and partial.code == "partially_published"
    assert [index for index, _ in partial.failures()] == [1, 3]
    assert str(partial).startswith("2 of 4 messages were written; messages[1], messages[3] were not")
