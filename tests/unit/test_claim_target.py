"""How many messages a shared member's new range takes of those it found past the cursor."""

from __future__ import annotations

from casque.engine.claims import WHOLE_CLAIM_MESSAGES, claim_target


def test_a_lone_message_or_a_trickle_is_claimed_whole_whatever_the_group() -> None:
    # Split over the members, a trickle made ranges of one message each: a claim (a read and
    # a ZooKeeper write) per message, with messages queued behind the claims.
    assert claim_target(1, members=2, most=256) == 1
    assert claim_target(3, members=2, most=256) == 3
    assert claim_target(WHOLE_CLAIM_MESSAGES, members=8, most=256) == WHOLE_CLAIM_MESSAGES


def test_a_backlog_past_the_whole_claim_is_split_over_the_members() -> None:
    assert claim_target(400, members=8, most=256) == 50
    assert claim_target(WHOLE_CLAIM_MESSAGES + 1, members=2, most=256) == WHOLE_CLAIM_MESSAGES
    # No member count yet (the group not read): the backlog is one member's.
    assert claim_target(100, members=0, most=256) == 100


def test_a_claim_takes_at_most_its_cap_and_at_least_one_batch() -> None:
    assert claim_target(1000, members=1, most=32) == 32
    assert claim_target(5, members=2, most=3) == 3
    assert claim_target(0, members=2, most=256) == 1
