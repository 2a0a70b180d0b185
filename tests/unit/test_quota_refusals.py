"""Which refused Queues a Namespace's change or a deletion tries again (casque.operator.refusals)."""

from __future__ import annotations

from casque.operator.failures import INVALID_QUOTA, QUOTA_EXCEEDED, Failure
from casque.operator.refusals import QuotaRefusals, quota_annotations

RAISED = {"quota.casque.io/max-queues": "2"}


def refusal(reason: str = QUOTA_EXCEEDED) -> Failure:
    return Failure(reason, "refused", 60.0)


def test_only_the_quota_annotations_count() -> None:
    assert quota_annotations({"quota.casque.io/max-queues": "2", "owner": "billing"}) == RAISED
    assert quota_annotations(None) == {}


def test_a_queue_refused_for_a_quota_is_tried_again_when_the_quota_annotations_change() -> None:
    refusals = QuotaRefusals()
    refusals.record("team-a", "orders", refusal(), {})
    refusals.record("team-a", "invoices", refusal(INVALID_QUOTA), {"quota.casque.io/max-queues": "x"})
    assert refusals.judged_by_other_quotas("team-a", {"owner": "billing"}) == ["invoices"]
    assert refusals.judged_by_other_quotas("team-a", {**RAISED, "owner": "billing"}) == ["invoices", "orders"]
    assert refusals.judged_by_other_quotas("team-b", RAISED) == []


def test_a_queue_applied_or_refused_for_another_reason_is_no_longer_tried_again() -> None:
    refusals = QuotaRefusals()
    refusals.record("team-a", "orders", refusal(), {})
    refusals.record("team-a", "invoices", refusal(), {})
    refusals.record("team-a", "orders", None, RAISED)
    refusals.record("team-a", "invoices", refusal("BackendUnavailable"), RAISED)
    assert refusals.refused("team-a") == []
    assert refusals.judged_by_other_quotas("team-a", RAISED) == []


def test_a_refusal_judged_again_keeps_the_annotations_of_its_latest_verdict() -> None:
    refusals = QuotaRefusals()
    refusals.record("team-a", "orders", refusal(), {})
    refusals.record("team-a", "orders", refusal(), RAISED)
    assert refusals.judged_by_other_quotas("team-a", RAISED) == []
    refusals.forget("team-a", "orders")
    refusals.forget("team-a", "orders")  # forgetting twice is harmless
    assert refusals.refused("team-a") == []
