"""What a schema check costs, whatever the data and the schema: data nested past the checked depth
is refused (never a RecursionError), and patterns match in linear time (RE2), the ones RE2 cannot
take being refused when the schema is applied."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from casque.dataschema.validation import MAX_DATA_DEPTH, CompiledSchema, invalid_schema, nests_within
from casque.errors import DataTooDeep, SchemaViolation
from casque.sidecar.errors import schema_refusal, status_of

TREE: dict[str, Any] = {"$defs": {"node": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "$ref": "#/$defs/node"}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("schema", [{}, {"type": "array"}, TREE])
def test_data_nested_past_the_depth_is_refused_with_its_code_and_at_the_depth_taken(schema: dict[str, Any]) -> None:
    check = CompiledSchema.of(schema, 2)
    check.check(nested(MAX_DATA_DEPTH), "application/json")
    for depth in (MAX_DATA_DEPTH + 1, 990, 5000, 100_000):  # 990 parses, then recursed in the check
        with pytest.raises(DataTooDeep) as refused:
            check.check(nested(depth), None)
        error = refused.value
        assert isinstance(error, SchemaViolation) and error.code == "data_too_deep"
        assert (error.path, error.rule, error.version) == ("", "maxDepth", 2)
        assert f"nests deeper than {MAX_DATA_DEPTH} levels" in str(error)


def test_a_refusal_for_depth_is_a_400_with_its_own_code() -> None:
    with pytest.raises(DataTooDeep) as refused:
        CompiledSchema.of({}, 1).check(b'{"a": ' + nested(MAX_DATA_DEPTH) + b"}", None)
    refusal = schema_refusal(refused.value, index=1)
    assert (status_of(refusal), refusal.code) == (400, "data_too_deep")
    assert refusal.details is not None and refusal.details[0].field == "messages[1].data"


def test_the_depth_is_measured_without_recursion_and_brackets_in_strings_do_not_count() -> None:
    assert nests_within(None, 0) and nests_within("[[[[", 0)
    assert nests_within([[1], {"a": [2]}], 3) and not nests_within([[1], {"a": [[2]]}], 3)
    value: list[Any] = []
    for _ in range(100_000):  # built by hand: the json module would not parse it
        value = [value]
    assert not nests_within(value, MAX_DATA_DEPTH)
    CompiledSchema.of({}, 1).check(b'["' + b"[" * 1000 + b'"]', None)


def test_a_backtracking_pattern_matches_in_linear_time() -> None:
    # With Python's re, 2^35 ways to split the a's before the "!" fails them all: minutes.
    check = CompiledSchema.of({"type": "string", "pattern": "^(a+)+$"}, 1)
    assert check.failure(b'"' + b"a" * 35 + b'!"', None).rule == "pattern"  # type: ignore[union-attr]
    assert check.failure(b'"' + b"a" * 35 + b'"', None) is None
    keys = CompiledSchema.of({"patternProperties": {"^(a+)+$": {"type": "string"}}}, 1)
    assert keys.failure(b'{"' + b"a" * 35 + b'!": 1}', None) is None  # the name does not match: unconstrained
    assert keys.failure(b'{"' + b"a" * 35 + b'": 1}', None).rule == "type"  # type: ignore[union-attr]


def test_patterns_keep_their_json_schema_meaning_under_re2() -> None:
    # Unanchored patterns search; `$` ends the text, not a final line.
    check = CompiledSchema.of({"type": "string", "pattern": "^o-[0-9]+$"}, 1)
    assert check.failure(b'"o-12"', None) is None
    assert check.failure(b'"o-12\\n"', None).rule == "pattern"  # type: ignore[union-attr]
    assert CompiledSchema.of({"pattern": "b"}, 1).failure(b'"abc"', None) is None


@pytest.mark.parametrize(("pattern", "why"), [
    ("(a)\\1", "RE2"),  # a back-reference: no linear-time matcher has one
    ("a(?=b)", "RE2"),  # lookahead
    ("(", "RE2"),
])
def test_a_pattern_re2_cannot_compile_is_refused_when_the_schema_is_applied(pattern: str, why: str) -> None:
    for schema in ({"pattern": pattern}, {"patternProperties": {pattern: {}}},
                   {"properties": {"id": {"type": "string", "pattern": pattern}}}):
        problem = invalid_schema(schema)
        assert problem is not None and why in problem and repr(pattern) in problem, problem


def test_a_pattern_that_is_no_string_is_refused_not_raised() -> None:
    assert invalid_schema({"properties": {"id": {"pattern": 5}}}) == "data.id: pattern must be a string"


def test_a_required_name_against_pattern_properties_is_judged_by_re2() -> None:
    # fastjsonschema checks at compile time whether a required name is allowed, with Python's re.
    schema = {"additionalProperties": False, "patternProperties": {"^(a+)+$": {}}, "required": ["a" * 35 + "!"]}
    problem = invalid_schema(schema)
    assert problem is not None and "required but not allowed" in problem
    assert invalid_schema({**schema, "required": ["a" * 35]}) is None


# A schema applied before patterns were matched by RE2 (0.1.0 matched them with Python's re).
KEPT = {"type": "string", "pattern": "^(a|aa)+(?=b)"}  # a lookahead, and backtracking before it


def test_a_schema_in_force_with_a_pattern_re2_refuses_is_read_and_still_checks_messages() -> None:
    from casque.specs import QueueSpec

    assert QueueSpec(shards=1, schema=KEPT).data_schema == KEPT  # a stored spec reads as it was accepted
    check = CompiledSchema.of(KEPT, 3)
    assert check.failure(b'"aab"', None) is None
    assert check.failure(b'"aac"', None).rule == "pattern"  # type: ignore[union-attr]
    assert invalid_schema(KEPT) is not None  # ... but no new schema may have it


def test_a_search_of_such_a_pattern_is_given_up_after_its_bound_and_refuses_the_message() -> None:
    from casque.dataschema.patterns import BOUNDED_SEARCH_SECONDS

    failure = CompiledSchema.of(KEPT, 3).failure(b'"' + b"a" * 60 + b'!"', None)  # 2^30 ways to fail: minutes
    assert failure is not None and failure.rule == "pattern"
    assert f"took longer than {BOUNDED_SEARCH_SECONDS * 1000:.0f} ms" in failure.problem


def test_a_new_or_changed_schema_must_be_linear_and_one_in_force_is_applied_again_as_it_is() -> None:
    from casque.engine import schema_versions
    from casque.errors import InvalidSpec
    from casque.schema import QueueRef
    from casque.specs import QueueSpec, QueueState

    queue = QueueRef("default", "orders")
    kept = QueueSpec(shards=1, schema=KEPT)
    with pytest.raises(InvalidSpec, match="RE2"):
        schema_versions.first_version(queue, kept)
    current = QueueState(spec=kept, schema_version=3, created_at=datetime.now(timezone.utc))
    assert schema_versions.next_version(queue, current, kept) == 3
    assert schema_versions.kept_from_before(kept) is not None
    changed = QueueSpec(shards=1, schema={**KEPT, "maxLength": 9}, schemaCompatibility="none")
    with pytest.raises(InvalidSpec, match="RE2"):
        schema_versions.next_version(queue, current, changed)
