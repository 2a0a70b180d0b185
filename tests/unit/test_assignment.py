"""Shard assignment (`leases.assign`): even loads, deterministic, and sticky across membership changes.

Every member computes the assignment on its own from the member list it sees, so the
function must give the same answer for the same set in any order. Stickiness matters
because every moved shard costs a lease handover: its holder flushes acks and offsets,
releases, and the next holder reloads the shard's unacked window.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable

import pytest

from casque.engine.leases import assign

MEMBER_COUNTS = range(2, 9)
SHARD_COUNTS = (12, 64)


def pod_members(count: int) -> list[str]:
    """Ids shaped like the sidecar's (pod name and a random suffix), deterministic here."""
    return [f"orders-worker-{i}-{hashlib.sha256(str(i).encode()).hexdigest()[:6]}" for i in range(count)]


def plain_members(count: int) -> list[str]:
    return [f"consumer-{i}" for i in range(count)]


Naming = Callable[[int], list[str]]

# Two naming schemes, so that no bound holds only by the luck of one set of hashes.
NAMINGS = pytest.mark.parametrize("naming", [pod_members, plain_members], ids=["pod", "plain"])


def owners(assignment: dict[str, set[int]]) -> dict[int, str]:
    return {shard: member for member, shards in assignment.items() for shard in shards}


def moved_shards(before: dict[str, set[int]], after: dict[str, set[int]]) -> int:
    """Shards whose owner changed: each one is a lease handover."""
    old_owner, new_owner = owners(before), owners(after)
    return sum(1 for shard, member in old_owner.items() if new_owner.get(shard) != member)


def join_bound(shards: int, members_after: int) -> int:
    # The joiner's fair share, plus as many again: the load bound cascades, so a member that
    # lost a shard to the joiner may take over another member's shard to fill its share.
    # (share + 1 does not hold: 64 shards, consumer-0..6 joined by consumer-7 moves 15, share 8.)
    return 2 * math.ceil(shards / members_after) + 2


def leave_bound(leaver_load: int) -> int:
    # The leaver's shards, plus as many again for the same cascade as on a join. (load + 1 does
    # not hold: 64 shards, consumer-7 leaving consumer-0..7 moves 15, its load 8.)
    return 2 * leaver_load + 2


@pytest.mark.parametrize("member_count", range(1, 10))
def test_every_shard_has_one_owner_and_loads_differ_by_at_most_one(member_count: int) -> None:
    members = pod_members(member_count)
    for shard_count in range(1, 65):
        shards = list(range(shard_count))
        assignment = assign(members, shards)
        owned = [shard for member_shards in assignment.values() for shard in member_shards]
        assert sorted(owned) == shards, (member_count, shard_count)
        loads = [len(assignment[member]) for member in members]
        assert max(loads) - min(loads) <= 1, (member_count, shard_count, loads)


def test_members_beyond_the_shard_count_own_nothing() -> None:
    members = pod_members(9)
    assignment = assign(members, [0, 1, 2])
    assert set(assignment) == set(members)
    assert sorted(len(shards) for shards in assignment.values()) == [0] * 6 + [1] * 3


@NAMINGS
def test_same_members_in_any_order_give_the_same_assignment(naming: Naming) -> None:
    # Each member sees the group's znodes in whatever order ZooKeeper lists them.
    members = naming(7)
    shards = list(range(64))
    expected = assign(members, shards)
    shuffler = random.Random(7)
    for _ in range(20):
        shuffled_members, shuffled_shards = members[:], shards[:]
        shuffler.shuffle(shuffled_members)
        shuffler.shuffle(shuffled_shards)
        assert assign(shuffled_members, shuffled_shards) == expected


@NAMINGS
@pytest.mark.parametrize("shard_count", SHARD_COUNTS)
def test_a_member_joining_moves_about_its_share(naming: Naming, shard_count: int) -> None:
    shards = list(range(shard_count))
    moved_total = share_total = 0
    for member_count in MEMBER_COUNTS:
        members = naming(member_count + 1)
        moved = moved_shards(assign(members[:-1], shards), assign(members, shards))
        assert moved <= join_bound(shard_count, member_count + 1), member_count
        moved_total += moved
        share_total += math.ceil(shard_count / (member_count + 1))
    # Cascades are the exception: over a run of group sizes a join moves about its share.
    assert moved_total <= 1.5 * share_total


@NAMINGS
@pytest.mark.parametrize("shard_count", SHARD_COUNTS)
def test_a_member_leaving_moves_about_its_shards(naming: Naming, shard_count: int) -> None:
    shards = list(range(shard_count))
    moved_total = leaver_load_total = 0
    for member_count in MEMBER_COUNTS:
        members = naming(member_count)
        before = assign(members, shards)
        for leaver in members:
            moved = moved_shards(before, assign([member for member in members if member != leaver], shards))
            assert moved <= leave_bound(len(before[leaver])), (member_count, leaver)
            moved_total += moved
            leaver_load_total += len(before[leaver])
    assert moved_total <= 1.5 * leaver_load_total


@NAMINGS
@pytest.mark.parametrize("shard_count", SHARD_COUNTS)
def test_each_step_of_a_rolling_restart_moves_about_two_shares(naming: Naming, shard_count: int) -> None:
    # A restarted pod comes back under a new id (the sidecar's random suffix), so each step
    # of a rolling restart swaps one member for a stranger.
    shards = list(range(shard_count))
    moved_total = replaced_load_total = 0
    for member_count in MEMBER_COUNTS:
        members = naming(member_count)
        current = assign(members, shards)
        for step, replaced in enumerate(list(members)):
            members = [f"restarted-{step}" if member == replaced else member for member in members]
            following = assign(members, shards)
            moved = moved_shards(current, following)
            # A swap is a leave then a join; a shard moved by the swap moved in one of the two.
            bound = leave_bound(len(current[replaced])) + join_bound(shard_count, member_count)
            assert moved <= bound, (member_count, step, replaced)
            moved_total += moved
            replaced_load_total += len(current[replaced])
            current = following
    # About two shares a step: the replaced member's shards go to the others, and the
    # newcomer takes its own share from them (it cannot know which shards were freed).
    assert moved_total <= 2 * replaced_load_total
