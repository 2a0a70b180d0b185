"""Queues refused for their namespace's quotas, so that a change which may let them in
reconciles them at once rather than at their next retry.

Two changes can make room: the platform team edits the Namespace's quota annotations (or
mends a malformed one), or a Queue of the namespace is deleted. The operator follows the
first through its watch of Namespaces and the second through its own delete handler; either
re-runs the refused Queues' apply (casque.operator.handlers.queues). The refusal's retry
stays as the fallback for what frees room unseen, such as another tenant's znodes going.

Kept in memory only: a restarted operator applies every Queue again as it resumes, refused
ones included, so nothing here has to outlive it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from casque.operator.failures import INVALID_QUOTA, QUOTA_EXCEEDED, Failure
from casque.operator.quotas import QUOTA_PREFIX

QUOTA_REASONS = frozenset({QUOTA_EXCEEDED, INVALID_QUOTA})


def quota_annotations(annotations: Mapping[str, str] | None) -> dict[str, str]:
    """The annotations that set the namespace's quotas, and no other."""
    return {key: value for key, value in (annotations or {}).items() if key.startswith(QUOTA_PREFIX)}


@dataclass
class QuotaRefusals:
    """Per namespace, each refused Queue's name and the quota annotations it was judged by."""

    _judged_by: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)

    def record(self, namespace: str, name: str, failure: Failure | None, annotations: Mapping[str, str]) -> None:
        """What became of a Queue's apply: refused for a quota, or anything else."""
        if failure is not None and failure.reason in QUOTA_REASONS:
            self._judged_by.setdefault(namespace, {})[name] = dict(annotations)
        else:
            self.forget(namespace, name)

    def forget(self, namespace: str, name: str) -> None:
        refused = self._judged_by.get(namespace)
        if refused is None:
            return
        refused.pop(name, None)
        if not refused:
            del self._judged_by[namespace]

    def refused(self, namespace: str) -> list[str]:
        """The namespace's refused Queues, by name."""
        return sorted(self._judged_by.get(namespace, {}))

    def judged_by_other_quotas(self, namespace: str, annotations: Mapping[str, str]) -> list[str]:
        """The refused Queues whose verdict used quota annotations other than `annotations`."""
        now = quota_annotations(annotations)
        return sorted(name for name, then in self._judged_by.get(namespace, {}).items() if then != now)
