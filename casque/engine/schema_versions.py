"""A queue's schema versions: what number a wanted schema gets, and whether it may replace the one in force.

The version lives in the queue's znode (`QueueState.schema_version`) beside the spec holding
the schema in force, and both are written in one `set`: a sidecar that reads the queue sees a
schema with its own number, never one with another's. A refused change writes nothing, so the
schema in force stays as it was.

A new schema (a queue's first, or a change) must have patterns RE2 matches; one in force from
before patterns were matched by RE2 is applied again as it is (casque.dataschema.patterns),
with a warning.
"""

from __future__ import annotations

from casque.dataschema.compatibility import incompatibilities
from casque.dataschema.validation import canonical, invalid_schema
from casque.errors import IncompatibleSchema, InvalidSpec
from casque.schema import QueueRef
from casque.specs import QueueSpec, QueueState


def first_version(queue: QueueRef, spec: QueueSpec) -> int:
    _require_linear(queue, spec)
    return 1 if spec.data_schema is not None else 0


def _require_linear(queue: QueueRef, spec: QueueSpec) -> None:
    problem = None if spec.data_schema is None else invalid_schema(spec.data_schema)
    if problem is not None:
        raise InvalidSpec(f"queue {queue}: schema: {problem}")


def kept_from_before(spec: QueueSpec) -> str | None:
    """Why the schema in force would not be accepted as a new one (a pattern RE2 refuses), if so."""
    return None if spec.data_schema is None else invalid_schema(spec.data_schema)


def same_schema(a: QueueSpec, b: QueueSpec) -> bool:
    if a.data_schema is None or b.data_schema is None:
        return a.data_schema is b.data_schema
    return canonical(a.data_schema) == canonical(b.data_schema)


def next_version(queue: QueueRef, current: QueueState, spec: QueueSpec) -> int:
    """The version `spec`'s schema gets on a queue whose state is `current`.

    Raises IncompatibleSchema when the queue asks for backward compatibility and the new
    schema may refuse a message the one in force accepts. A queue without a schema accepted
    every message, so giving an existing queue its first schema takes `schemaCompatibility:
    none` (a new queue may start with one).
    """
    if same_schema(current.spec, spec):
        return current.schema_version
    _require_linear(queue, spec)
    if spec.schema_compatibility == "backward" and spec.data_schema is not None:
        old = current.spec.data_schema if current.spec.data_schema is not None else True
        reasons = incompatibilities(old, spec.data_schema)
        if reasons:
            shown = "; ".join(reasons[:5]) + (f" (and {len(reasons) - 5} more)" if len(reasons) > 5 else "")
            raise IncompatibleSchema(
                f"queue {queue}: the new schema is not backward compatible with version "
                f"{current.schema_version}, which stays in force: {shown}. Set schemaCompatibility: none "
                "to change it anyway"
            )
    return current.schema_version + 1
