"""The installation's protocol version as its readers take it: an absent znode is the baseline,
a version or format above this release's is refused (never read as a lower one), and a
member that says nothing of its protocol is taken for the baseline (a release before it)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from kazoo.security import ACL, ANYONE_ID_UNSAFE, Permissions

from casque.backends.zkacl import Identity, installation_policy
from casque.engine.protocol import BASELINE, PROTOCOL, ProtocolLevel, parse
from casque.engine.protocol_change import ProtocolChange, member_protocol
from casque.errors import InvalidSpec, NewerFormat


def test_an_absent_or_empty_znode_is_the_baseline() -> None:
    assert parse(None).version == BASELINE
    assert parse(b"").version == BASELINE


def test_a_version_this_release_speaks_is_read() -> None:
    assert parse(json.dumps({"format": 1, "version": PROTOCOL}).encode()).version == PROTOCOL


@pytest.mark.parametrize("fields, says", [
    ({"format": 1, "version": PROTOCOL + 1}, f"runs protocol {PROTOCOL + 1}; this version of casque speaks up to"),
    ({"format": 2, "version": 1}, "written in format 2; this version of casque reads up to 1"),
])
def test_a_later_version_or_format_is_refused(fields: dict[str, int], says: str) -> None:
    with pytest.raises(NewerFormat, match=says):
        parse(json.dumps(fields).encode())


def test_a_broken_znode_is_refused_with_what_is_wrong() -> None:
    with pytest.raises(InvalidSpec, match="no JSON"):
        parse(b"{")
    with pytest.raises(InvalidSpec, match="not a protocol record"):
        parse(json.dumps({"version": "two"}).encode())


def test_a_level_that_meets_a_later_version_writes_the_baseline_and_refuses_until_it_is_lowered() -> None:
    level = ProtocolLevel()
    level._changed(json.dumps({"version": 2}).encode())
    assert level.version == 2 and level.refusal is None
    level._changed(json.dumps({"version": PROTOCOL + 1}).encode())
    assert level.version == BASELINE
    with pytest.raises(NewerFormat):
        level.check()
    level._changed(None)  # the znode deleted: the baseline, which this release speaks
    assert level.version == BASELINE and level.refusal is None
    level.check()


@pytest.mark.parametrize("data, protocol", [
    (None, BASELINE),
    (b"", BASELINE),  # a member of 0.1.0 before its first report
    (json.dumps({"in_flight": 3, "acked": 10}).encode(), BASELINE),  # 0.1.0's report
    (json.dumps({"protocol": 2}).encode(), 2),
    (json.dumps({"in_flight": 0, "protocol": 2}).encode(), 2),
    (b"not json", BASELINE),
])
def test_a_member_says_its_protocol_or_is_taken_for_the_baseline(data: bytes | None, protocol: int) -> None:
    assert member_protocol(data) == protocol


def test_a_lowering_says_until_when_records_of_the_higher_version_are_read() -> None:
    until = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
    assert ProtocolChange(2, 1, until).describe() == (
        "protocol 2 -> 1; records of protocol 2 may be read until 2026-12-02T12:00:00+00:00: "
        "roll sidecars back after that")
    assert ProtocolChange(1, 2, None).describe() == "protocol 1 -> 2"
    assert ProtocolChange(2, 2, None).describe() == "protocol 2 (unchanged)"


def test_every_identity_may_read_the_protocol_and_only_the_installation_write_it() -> None:
    owner = Identity("casque", "a" * 32)
    policy = installation_policy("/casque", [owner], ["k" * 32])
    assert policy.acl_for("/casque/protocol") == [ACL(Permissions.ALL, owner.acl_id),
                                                 ACL(Permissions.READ, ANYONE_ID_UNSAFE)]
