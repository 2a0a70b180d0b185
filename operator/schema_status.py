"""The Queue's `SchemaCompatible` condition: whether the schema the spec asks for is in force.

True once the spec's schema is the one the queue checks messages against (or the queue has
none); False, with the reasons, when the change was refused as not backward compatible
(casque.dataschema.compatibility), in which case the version before stays in force and
`status.schemaVersion` still names it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from casque.operator import conditions

SCHEMA_COMPATIBLE = "SchemaCompatible"
IN_FORCE = "InForce"
NO_SCHEMA = "NoSchema"
INCOMPATIBLE = "Incompatible"


def in_force(
    current: Sequence[Mapping[str, Any]] | None, version: int | None, has_schema: bool, generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    if has_schema:
        reason, message = IN_FORCE, f"schema version {version} is in force"
    else:
        reason, message = NO_SCHEMA, "the queue has no schema: any data is accepted"
    return conditions.with_condition(current, SCHEMA_COMPATIBLE, status=True, reason=reason, message=message,
                                     generation=generation, now=now)


def refused(
    current: Sequence[Mapping[str, Any]] | None, why: str, generation: int | None, now: datetime
) -> list[dict[str, Any]]:
    return conditions.with_condition(current, SCHEMA_COMPATIBLE, status=False, reason=INCOMPATIBLE, message=why,
                                     generation=generation, now=now)
