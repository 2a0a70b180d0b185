"""A claim znode's contents: what a member writes is what another reads."""

from __future__ import annotations

import json

from casque.engine.claims import ClaimRecord, parse_claim


def test_a_claim_says_which_session_wrote_it_and_an_older_one_that_does_not_reads_as_unknown() -> None:
    record = ClaimRecord(shard=3, epoch=2, start=40, end=48, member="m1", until_ms=1_700_000_000_000, version=5,
                         keys=frozenset({7, 9}), session=0x1234_5678_9ABC)
    assert parse_claim(3, record.name, record.data(), 5) == record
    older = json.dumps({"member": "m1", "end": 48, "until": 1_700_000_000_000}).encode()
    assert parse_claim(3, record.name, older, 5).session == 0


def test_a_claim_says_when_a_dead_letter_in_it_is_due_and_one_without_reads_as_none() -> None:
    record = ClaimRecord(shard=0, epoch=0, start=1, end=2, member="m1", until_ms=0, version=1,
                         wake_ms=1_700_000_004_000)
    assert parse_claim(0, record.name, record.data(), 1) == record
    assert "wake" not in json.loads(ClaimRecord(0, 0, 1, 2, "m1", 0, 1).data())
