"""`status.conditions` as Kubernetes API conventions describe them, and status merge patches.

A condition's `lastTransitionTime` moves only when its status flips, so a re-reconcile that
finds everything in place (an operator restart, a timer) leaves the condition as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

READY = "Ready"


def timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with second precision, as Kubernetes writes times."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def find(conditions: Sequence[Mapping[str, Any]] | None, kind: str) -> Mapping[str, Any] | None:
    for condition in conditions or ():
        if condition.get("type") == kind:
            return condition
    return None


def with_condition(
    conditions: Sequence[Mapping[str, Any]] | None,
    kind: str,
    *,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    """`conditions` with the one of type `kind` set; the others are kept as they are."""
    before = find(conditions, kind)
    text = "True" if status else "False"
    if before is not None and before.get("status") == text and before.get("lastTransitionTime"):
        since = str(before["lastTransitionTime"])
    else:
        since = timestamp(now)
    condition: dict[str, Any] = {
        "type": kind,
        "status": text,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    others = [dict(c) for c in conditions or () if c.get("type") != kind]
    return sorted([*others, condition], key=lambda c: str(c.get("type")))


def merge_patch(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of `wanted` that differ from `current`: a JSON merge patch of the status.

    A key whose wanted value is None is removed (if present). Keys absent from `wanted` are
    left alone, so the status refresh does not erase what only a reconcile writes.
    """
    current = current or {}
    patch: dict[str, Any] = {}
    for key, value in wanted.items():
        if value is None:
            if current.get(key) is not None:
                patch[key] = None
        elif current.get(key) != value:
            patch[key] = value
    return patch
