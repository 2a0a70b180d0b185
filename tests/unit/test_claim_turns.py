"""Whose turn it is to claim a shard's fresh batches (casque.engine.claim_turns)."""

from __future__ import annotations

import asyncio
from collections import Counter

from casque.engine.claim_turns import ABSENT_SECONDS, TURN_WAIT_SECONDS, ClaimTurns, turn_of
from casque.engine.claims import WHOLE_CLAIM_MESSAGES, Cursor

MEMBERS = ["m-a", "m-b", "m-c"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def turns_of(member: str, clock: Clock, members: list[str] = MEMBERS) -> tuple[ClaimTurns, list[float]]:
    wakes: list[float] = []
    return ClaimTurns(member, lambda: members, wakes.append, clock), wakes


def head_of_turn(member: str, shard: int = 0, members: list[str] = MEMBERS) -> int:
    return next(head for head in range(1, 1000) if turn_of(members, shard, head) == member)


def test_every_member_names_the_same_turn_whatever_order_it_sees_the_members_in() -> None:
    for head in range(50):
        assert turn_of(MEMBERS, 1, head) == turn_of(list(reversed(MEMBERS)), 1, head)


def test_turns_spread_over_the_members_as_the_head_moves() -> None:
    for shard in (0, 1):
        counts = Counter(turn_of(MEMBERS, shard, head) for head in range(3000))
        assert set(counts) == set(MEMBERS)
        assert min(counts.values()) > 800  # about a third each


def test_a_member_claims_its_own_turn_at_once_and_holds_off_on_anothers() -> None:
    clock = Clock()
    turns, wakes = turns_of("m-a", clock)
    assert not turns.hold_off(0, head_of_turn("m-a"), head_of_turn("m-a"))
    other = head_of_turn("m-b")
    assert turns.hold_off(0, other, other)
    assert wakes == [TURN_WAIT_SECONDS]  # asked to look again once the wait runs out
    assert turns.hold_off(0, other, other)
    assert wakes == [TURN_WAIT_SECONDS]  # one wait, one wake


def test_a_backlog_larger_than_one_claim_takes_is_claimed_by_all_at_once() -> None:
    turns, wakes = turns_of("m-a", Clock())
    head = head_of_turn("m-b")
    assert turns.hold_off(0, head, head - WHOLE_CLAIM_MESSAGES + 1)
    turns, wakes = turns_of("m-a", Clock())
    assert not turns.hold_off(0, head, head - WHOLE_CLAIM_MESSAGES)
    assert wakes == []


def test_a_member_alone_or_not_yet_seen_in_the_group_never_holds_off() -> None:
    clock = Clock()
    alone, _ = turns_of("m-a", clock, ["m-a"])
    assert not alone.hold_off(0, 7, 7)
    unseen, _ = turns_of("m-z", clock)
    assert not any(unseen.hold_off(0, head, head) for head in range(20))


def wait_out_m_b(clock: Clock) -> tuple[ClaimTurns, list[float], int]:
    """m-a, having left one of m-b's turns to it until the wait ran out."""
    turns, wakes = turns_of("m-a", clock)
    head = head_of_turn("m-b")
    assert turns.hold_off(0, head, head)
    clock.now += TURN_WAIT_SECONDS
    assert not turns.hold_off(0, head, head)  # m-b had its time
    return turns, wakes, head


def test_a_wait_that_ran_out_with_its_batches_unclaimed_marks_their_member_absent_for_a_while() -> None:
    clock = Clock()
    turns, wakes, head = wait_out_m_b(clock)
    turns.settle(0, head)  # the cursor read again: still at m-b's batch
    assert turns.absences == 1
    later = next(h for h in range(head + 1, 1000) if turn_of(MEMBERS, 0, h) == "m-b")
    assert not turns.hold_off(0, later, later)  # m-b is absent: no wait for its turns
    clock.now += ABSENT_SECONDS
    assert turns.hold_off(0, later, later)  # ... for a while only
    assert len(wakes) == 2


def test_a_wait_whose_batches_were_claimed_marks_nobody_absent() -> None:
    turns, _, head = wait_out_m_b(Clock())
    turns.settle(0, head + 1)  # m-b claimed them
    assert turns.absences == 0
    assert turns.hold_off(0, head, head)  # its next turn is waited for again


def test_a_wait_keeps_its_deadline_while_the_head_moves_through_other_members_turns() -> None:
    clock = Clock()
    turns, wakes = turns_of("m-a", clock, ["m-a", "m-b"])
    heads = [h for h in range(1, 200) if turn_of(["m-a", "m-b"], 0, h) == "m-b"][:3]
    assert turns.hold_off(0, heads[0], heads[0])
    clock.now += TURN_WAIT_SECONDS / 2
    assert turns.hold_off(0, heads[1], heads[0])
    clock.now += TURN_WAIT_SECONDS / 2
    assert not turns.hold_off(0, heads[2], heads[0])  # the first deadline, not one pushed on
    assert wakes == [TURN_WAIT_SECONDS]


def test_the_cursor_is_read_again_before_claiming_after_holding_off() -> None:
    clock = Clock()
    turns, _ = turns_of("m-a", clock, ["m-a", "m-b"])
    other = head_of_turn("m-b", members=["m-a", "m-b"])
    mine = next(h for h in range(other + 1, 1000) if turn_of(["m-a", "m-b"], 0, h) == "m-a")
    reads: list[int] = []

    async def read_cursor() -> Cursor:
        reads.append(1)
        return Cursor(other + 1, 0, 5)

    stale = Cursor(other, 0, 4)
    assert asyncio.run(turns.cursor_to_claim(0, other, stale, read_cursor)) is None
    assert reads == []
    assert asyncio.run(turns.cursor_to_claim(0, mine, stale, read_cursor)) == Cursor(other + 1, 0, 5)
    assert reads == [1]
    known = Cursor(mine + 1, 0, 6)  # this member's own claim left it there
    assert asyncio.run(turns.cursor_to_claim(0, mine + 1, known, read_cursor)) in (None, known)
    assert reads == [1]  # the next head after one judged here: nobody else's turn came between


def test_the_cursor_is_read_again_first_and_after_heads_this_member_never_judged() -> None:
    turns, _ = turns_of("m-a", Clock(), ["m-a"])
    reads: list[int] = []

    async def read_cursor() -> Cursor:
        reads.append(1)
        return Cursor(9, 0, 9)

    def judge(head: int) -> None:
        asyncio.run(turns.cursor_to_claim(0, head, Cursor(head, 0, 1), read_cursor))

    judge(5)
    assert len(reads) == 1  # the cursor known may be from long ago
    judge(6)
    assert len(reads) == 1  # the next head: nobody's turn came between
    judge(8)
    assert len(reads) == 2  # head 7 was never judged here: it may have been another's turn
