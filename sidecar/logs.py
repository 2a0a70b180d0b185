"""A request id per HTTP request, and the optional access log.

The id comes from the request's `X-Request-Id` when it is a sensible token (so a caller's
id follows the request through its sidecar), else a fresh one; it is answered in the
`X-Request-Id` header and set in casque.logs.REQUEST_ID while the request is handled, so
every line logged meanwhile names it. The access log, off by default, is one line per
request written here rather than by aiohttp's access logger, which runs after the
request's context is gone and could not name the id.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.typedefs import Middleware

from casque.logs import REQUEST_ID

log = logging.getLogger("casque.sidecar.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID_HEADER = "X-Request-Id"
# A caller's id is echoed into headers and logs: only short plain tokens are taken as they are.
_ACCEPTED_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


# Ids made here: this process's random prefix and a count. Unique like a uuid4 across
# processes, without a read of the kernel's random source on every request.
_ID_PREFIX = uuid.uuid4().hex[:12]
_made_ids = itertools.count(1)


def request_id_of(request: web.Request) -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if _ACCEPTED_ID.fullmatch(given) else f"{_ID_PREFIX}-{next(_made_ids):x}"


def request_middleware(access_log: bool) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = request_id_of(request)
        token = REQUEST_ID.set(request_id)
        started = time.perf_counter()
        status = 500
        try:
            try:
                response = await handler(request)
            except web.HTTPException as http:  # answered as it is, with the id too
                status = http.status
                http.headers[REQUEST_ID_HEADER] = request_id
                raise
            status = response.status
            response.headers[REQUEST_ID_HEADER] = request_id
            return response
        finally:
            if access_log:
                log.info("%s %s %d %.1fms", request.method, request.path, status,
                         (time.perf_counter() - started) * 1000,
                         extra={"method": request.method, "path": request.path, "status": status,
                                "duration_ms": round((time.perf_counter() - started) * 1000, 3)})
            REQUEST_ID.reset(token)

    return middleware


class MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a NUL in a header, a broken request line) as an
    error with a traceback, though it answers it 400 and nothing in the sidecar failed: any
    client could fill the log with them. Such a record becomes one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "malformed HTTP request refused (400): %s", (str(error).splitlines()[0],)
            record.exc_info = record.exc_text = None
        return True


def quiet_malformed_requests() -> None:
    logging.getLogger("aiohttp.server").addFilter(MalformedRequests())

