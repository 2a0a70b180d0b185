"""Why a flow did not reach the wanted state: a condition reason and a retry delay
(`Failure`, `classify`), and the one place where driver errors that mean "not now" become
BackendUnavailable (`backend_errors`, `in_thread`).

The kopf handlers turn a Failure into `PermanentError` or `TemporaryError`, the CLI into an
exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from kazoo.exceptions import QuotaExceededError

from casque.backends import cql, zk
from casque.errors import (
    BackendUnavailable,
    CasqueError,
    IncompatibleSchema,
    InvalidChange,
    InvalidSpec,
    QueueNotFound,
    QuotaExceeded,
)

P = ParamSpec("P")
T = TypeVar("T")

# Reasons of the Ready condition.
RECONCILED = "Reconciled"
DRIFTED = "Drifted"
INVALID_SPEC = "InvalidSpec"
INVALID_CHANGE = "InvalidChange"
INCOMPATIBLE_SCHEMA = "IncompatibleSchema"
BACKEND_UNAVAILABLE = "BackendUnavailable"
QUEUE_NOT_FOUND = "QueueNotFound"
DEAD_LETTER_QUEUE_NOT_FOUND = "DeadLetterQueueNotFound"
INTERNAL_ERROR = "InternalError"
QUOTA_EXCEEDED = "QuotaExceeded"
INVALID_QUOTA = "InvalidQuota"  # a Namespace's quota annotation that does not parse

# Seconds before retrying: a backend outage is usually a restart or a failover; a missing
# queue is usually a Subscriber applied in the same breath as its Queue.
BACKEND_RETRY_SECONDS = 20.0
QUEUE_RETRY_SECONDS = 5.0
ERROR_RETRY_SECONDS = 60.0
# A refused queue may fit once another is deleted or the quota raised. Both are followed as
# they happen (casque.operator.refusals); the retry is for what frees room unseen.
QUOTA_RETRY_SECONDS = 60.0


@dataclass(frozen=True)
class Failure:
    """Why a flow did not reach the wanted state, as a condition reason and message."""

    reason: str
    message: str
    # None: permanent, retrying cannot help until the spec changes.
    retry_after: float | None
    error: BaseException | None = field(default=None, compare=False)

    @property
    def permanent(self) -> bool:
        return self.retry_after is None


def classify(error: BaseException) -> Failure:
    # IncompatibleSchema is an InvalidChange, which is an InvalidSpec: most specific first.
    if isinstance(error, IncompatibleSchema):
        return Failure(INCOMPATIBLE_SCHEMA, str(error), None, error)
    if isinstance(error, InvalidChange):
        return Failure(INVALID_CHANGE, str(error), None, error)
    if isinstance(error, InvalidSpec):
        return Failure(INVALID_SPEC, str(error), None, error)
    if isinstance(error, BackendUnavailable):
        return Failure(BACKEND_UNAVAILABLE, str(error), BACKEND_RETRY_SECONDS, error)
    if isinstance(error, QueueNotFound):
        return Failure(QUEUE_NOT_FOUND, str(error), QUEUE_RETRY_SECONDS, error)
    if isinstance(error, QuotaExceeded):
        return Failure(QUOTA_EXCEEDED, str(error), QUOTA_RETRY_SECONDS, error)
    if isinstance(error, CasqueError):
        return Failure(type(error).__name__, str(error), ERROR_RETRY_SECONDS, error)
    return Failure(INTERNAL_ERROR, f"{type(error).__name__}: {error}", ERROR_RETRY_SECONDS, error)


@contextlib.contextmanager
def backend_errors() -> Iterator[None]:
    """Driver errors that mean "not now" become BackendUnavailable, which is retried.

    The catalog calls the drivers directly; their timeouts and connection losses are mapped
    here, once, for every flow.
    """
    try:
        yield
    except (*cql.RETRYABLE, *zk.RETRYABLE) as error:
        raise BackendUnavailable(f"{type(error).__name__}: {error}") from error
    except QuotaExceededError as error:  # a queue's znodes in a namespace at its quota
        raise zk.over_quota("the namespace's queues") from error


async def in_thread(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a blocking catalog or driver call in a worker thread, its driver errors mapped."""

    def call() -> T:
        with backend_errors():
            return function(*args, **kwargs)

    return await asyncio.to_thread(call)
