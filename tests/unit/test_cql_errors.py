"""How driver failures map to casque's errors, and how long the driver waits before one
(casque.backends.cql)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from cassandra import ConsistencyLevel, OperationTimedOut, WriteTimeout, WriteType
from cassandra.cluster import EXEC_PROFILE_DEFAULT, NoHostAvailable
from cassandra.protocol import ErrorMessage

from casque.backends import cql
from casque.config import Settings
from casque.errors import BackendUnavailable, WriteOutcomeUnknown


class FailedResponse:
    """Stands in for the driver's ResponseFuture of a request that failed with `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def add_callbacks(self, on_result: Callable[[Any], None], on_error: Callable[[BaseException], None]) -> None:
        on_error(self.error)


@pytest.mark.parametrize("error, expected", [
    (ErrorMessage(code=cql.CAS_WRITE_UNKNOWN, message="CAS operation result is unknown", info=None),
     WriteOutcomeUnknown),
    (WriteTimeout("timed out", consistency=ConsistencyLevel.QUORUM, required_responses=2, received_responses=1,
                  write_type=WriteType.CAS),
     WriteOutcomeUnknown),
])
def test_a_write_that_may_have_been_applied_is_an_unknown_outcome(error: BaseException, expected: type) -> None:
    with pytest.raises(expected) as raised:
        asyncio.run(cql._result(FailedResponse(error)))  # type: ignore[arg-type]
    assert isinstance(raised.value, BackendUnavailable)  # retryable for callers that do not settle it


def test_other_server_errors_are_not_taken_for_unknown_outcomes() -> None:
    invalid = ErrorMessage(code=0x2200, message="Invalid query", info=None)
    with pytest.raises(ErrorMessage):
        asyncio.run(cql._result(FailedResponse(invalid)))  # type: ignore[arg-type]


class UnreachableCluster:
    """Stands in for the driver's Cluster: keeps what it was made with; no node answers."""

    made_with: dict[str, Any] = {}

    def __init__(self, contact_points: list[str], **options: Any) -> None:
        UnreachableCluster.made_with = options

    def connect(self) -> None:
        raise NoHostAvailable("Unable to connect to any servers", {"127.0.0.1:9042": OperationTimedOut()})

    def shutdown(self) -> None:
        pass


def test_the_control_connection_waits_as_long_as_a_request_before_a_node_counts_as_unreachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The driver's own 2 s: a CLI command against a node busy for longer said it was unreachable.
    monkeypatch.setattr(cql, "Cluster", UnreachableCluster)
    with pytest.raises(BackendUnavailable, match="unreachable"):
        cql.connect(Settings())
    options = UnreachableCluster.made_with
    request_timeout = options["execution_profiles"][EXEC_PROFILE_DEFAULT].request_timeout
    assert options["control_connection_timeout"] == request_timeout == cql.REQUEST_TIMEOUT_SECONDS
