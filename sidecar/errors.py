"""The one place where failures become HTTP answers.

Every error leaves the sidecar as `{"error": {"code": ..., "message": ...}}` with a stable
code. Bad input is a 4xx and names what was wrong; a 5xx means our fault, or a backend
that did not answer (503 with Retry-After, safe to retry: publishes carry an id).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from cassandra import DriverException
from cassandra import Unauthorized as CassandraUnauthorized
from cassandra.connection import ConnectionException
from cassandra.protocol import ServerError
from kazoo.exceptions import KazooException, NoAuthError
from kazoo.handlers.threading import KazooTimeoutError
from pydantic import ValidationError

from casque.backends import cql, zk
from casque.engine.member import ConsumerStopped
from casque.engine.messages import Published
from casque.engine.messages import InvalidReceipt
from casque.errors import (
    AccessDenied,
    BackendUnavailable,
    CasqueError,
    InvalidChange,
    InvalidSpec,
    MessageNotFound,
    MessageTooLarge,
    PositionOutOfRange,
    NewerFormat,
    PartiallyPublished,
    QueueNotFound,
    QuotaExceeded,
    SchemaViolation,
    StaleReceipt,
    SubscriberNotFound,
    UntraceableId,
)
from casque.sidecar.models.base import ErrorBody, ErrorDetail, ErrorResponse
from casque.sidecar.models.publishing import PublishBatchError, PublishResult

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SidecarError(CasqueError):
    """Refusals that only the HTTP layer knows about."""

    status = 400

    def __init__(self, message: str, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class InvalidRequest(SidecarError):
    code = "invalid_request"

    def __init__(self, message: str, details: list[ErrorDetail] | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.details = details


class Unauthorized(SidecarError):
    code = "unauthorized"
    status = 401


class SubscriberNotServed(SidecarError):
    """The subscriber exists, but this sidecar does not consume for it."""

    code = "subscriber_not_served"
    status = 404


class RequestTooLarge(SidecarError):
    code = "request_too_large"
    status = 413


class HeadersTooLarge(SidecarError):
    code = "headers_too_large"
    status = 431


class TooManyValues(SidecarError):
    code = "too_many_values"
    status = 413


class RequestTimeout(SidecarError):
    code = "request_timeout"
    status = 408


class UnsupportedMediaType(SidecarError):
    code = "unsupported_media_type"
    status = 415


class ForeignHost(SidecarError):
    """A Host header naming another machine: a page that rebound its own name to 127.0.0.1."""

    code = "foreign_host"
    status = 421


class CrossOrigin(SidecarError):
    """A request a web page sent (it carries the page's Origin): apps in the pod send none."""

    code = "cross_origin"
    status = 403


class OutOfScope(SidecarError):
    """The pod's scopes (casque.sidecar.scopes) do not include this queue or subscriber."""

    code = "out_of_scope"
    status = 403


class NotReady(SidecarError):
    """Starting, or shutting down: try again (on this sidecar, or on the next pod)."""

    code = "not_ready"
    status = 503


def schema_refusal(error: SchemaViolation, index: int | None) -> InvalidRequest:
    """A message that broke its queue's schema, as a 400 naming the message (in a batch), the
    path in its data and the rule."""
    field = "data" if index is None else f"messages[{index}].data"
    where = "" if index is None else f"messages[{index}]: "
    detail = ErrorDetail(field=field, problem=str(error), path=error.path, rule=error.rule,
                         schema_version=error.version)
    return InvalidRequest(f"{where}{error}", [detail], code=error.code)  # data_too_deep keeps its own


# Most specific class first: the first match in an error's MRO wins.
STATUS: Mapping[type[CasqueError], int] = {
    InvalidReceipt: 400,
    InvalidChange: 409,
    # A request the document allows that the queue's spec or log cannot take now (a priority
    # beyond its levels, a delay beyond its retention, a seek outside the log): a conflict
    # with the queue's current state, as a stale receipt is with the delivery's.
    InvalidSpec: 409,
    PositionOutOfRange: 409,
    QueueNotFound: 404,
    SubscriberNotFound: 404,
    MessageNotFound: 404,
    # No message can be found by an id that carries no time: not found, with the reason in its
    # code (a 400 would tell a client that followed the document's link from a publish that
    # its request was malformed).
    UntraceableId: 404,
    StaleReceipt: 409,
    SchemaViolation: 400,
    MessageTooLarge: 413,
    BackendUnavailable: 503,
    ConsumerStopped: 503,
    # The sidecar's ZooKeeper identity may not touch what the call needs: its credentials
    # are another namespace's or out of date. Retrying cannot help until they are fixed.
    AccessDenied: 403,
    # The queue's spec in ZooKeeper is beyond what the operator granted (casque.engine.grants):
    # it conflicts with the queue's state until the operator restores it.
    QuotaExceeded: 409,
    # A record written by a later casque (a rollback over its data): refused, not misread;
    # it answers once this sidecar runs that version again.
    NewerFormat: 503,
}


# Every way the drivers say "a backend did not do it now; it may later": the caller gets a
# 503 with Retry-After. The driver's request-validation errors (bad CQL) are not here: those
# are our faults and stay 500s.
BACKEND_FAILURES: tuple[type[BaseException], ...] = (
    *cql.RETRYABLE,
    *zk.RETRYABLE,
    DriverException,  # OperationTimedOut and the driver's other client-side failures
    ConnectionException,
    ServerError,
    KazooException,  # ZooKeeper refused or lost the call (a znode deleted under it included)
    KazooTimeoutError,
)


def as_casque_error(error: BaseException) -> CasqueError | None:
    """A driver's failure as casque's error (None: not a backend failure, so our fault)."""
    if isinstance(error, CasqueError):
        return error
    if isinstance(error, NoAuthError):
        return AccessDenied("ZooKeeper refused the sidecar's identity this operation")
    if isinstance(error, CassandraUnauthorized):
        # The namespace's role may write only what consuming needs while it is over its
        # stored-bytes or write-rate quota (casque.operator.storage_quota); or its grants are wrong.
        return AccessDenied(f"Cassandra refused the namespace's role this write ({error}): a namespace over its "
                            "stored-bytes quota or its write-rate quota may not publish until it is under (its "
                            "Queues' Publishing condition says)")
    if isinstance(error, BACKEND_FAILURES):
        return BackendUnavailable(f"{type(error).__name__}: {error}")
    return None


def status_of(error: CasqueError) -> int:
    if isinstance(error, SidecarError):
        return error.status
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_body(error: CasqueError) -> ErrorBody:
    """How one error reads in a response (also inside per-receipt results)."""
    details = getattr(error, "details", None)
    if details:
        return ErrorBody(code=error.code, message=str(error), details=details)
    return ErrorBody(code=error.code, message=str(error))


def respond(status: int, body: ErrorBody, headers: Mapping[str, str] | None = None) -> web.Response:
    extra = dict(headers or {})
    if status == 503:
        extra.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))
    return web.json_response(ErrorResponse(error=body).wire(), status=status, headers=extra)


def partly_published(partial: PartiallyPublished) -> web.Response:
    """A publish call of which part was written: 503 with Retry-After, each message not
    written named in the details with its own error, and where each written one is."""
    details = []
    for index, failure in partial.failures():
        error = as_casque_error(failure) or CasqueError(f"{type(failure).__name__}: {failure}")
        details.append(ErrorDetail(field=f"messages[{index}]", problem=str(error), code=error.code))
    log.warning("publish: %s: %s", partial.code, partial)
    results = [PublishResult.of(o) if isinstance(o, Published) else None for o in partial.outcomes]
    body = PublishBatchError(error=ErrorBody(code=partial.code, message=str(partial), details=details), results=results)
    return web.Response(body=body.wire_json(), status=503, content_type="application/json",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def from_validation(error: ValidationError, what: str = "request body") -> InvalidRequest:
    """A pydantic failure as one readable line plus a detail per field."""
    details = []
    for item in error.errors(include_url=False, include_input=False):
        if item["type"] == "json_invalid":
            return InvalidRequest(f"{what} is not valid JSON: {item['msg']}", code="invalid_json")
        location = ".".join(str(part) for part in item["loc"]) or "(body)"
        details.append(ErrorDetail(field=location, problem=item["msg"]))
    summary = "; ".join(f"{d.field}: {d.problem}" for d in details[:5])
    more = f" (and {len(details) - 5} more)" if len(details) > 5 else ""
    return InvalidRequest(f"invalid {what}: {summary}{more}", details)


# aiohttp's own refusals (no route, wrong method, body too large) in our format.
_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await _answer(request, handler)
    if response.status >= 400 and request.can_read_body:
        # Refused before its body was read (too large, too slow, foreign): close rather than
        # read and discard the rest, which would let the client keep the connection busy.
        response.force_close()
    return response


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except CasqueError as error:
        status = status_of(error)
        headers = {"WWW-Authenticate": 'Bearer realm="casque"'} if isinstance(error, Unauthorized) else None
        if status >= 500:
            log.warning("%s %s: %s: %s", request.method, request.path, error.code, error)
        return respond(status, error_body(error), headers)
    except web.HTTPException as http:
        if http.status < 400:
            raise
        code = _HTTP_CODES.get(http.status, "http_error")
        message = http.text or http.reason
        if http.status == 413:
            message = f"request body too large: {http.text}"
        headers = {k: v for k, v in http.headers.items() if k.lower() == "allow"}
        return respond(http.status, ErrorBody(code=code, message=message.strip()), headers)
    except Exception as failure:
        mapped = as_casque_error(failure)
        if mapped is not None:
            log.warning("%s %s: backend failure: %r", request.method, request.path, failure)
            return respond(status_of(mapped), error_body(mapped))
        # Our fault. Nothing partial was acknowledged: an unfinished publish returns no success.
        log.exception("%s %s failed", request.method, request.path)
        return respond(500, ErrorBody(code="internal", message="internal error in the sidecar; see its log"))
