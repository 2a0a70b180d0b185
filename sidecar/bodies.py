"""Reading and parsing request bodies within the sidecar's limits.

The size limit is enforced before reading: a Content-Length over it is refused without
reading a byte, and a chunked body is counted as it arrives and refused the moment it
passes the limit, so no request makes the sidecar hold more than the limit. A body must
arrive within `body_timeout_seconds`, so a trickling client cannot keep its buffer forever.

Parsing a large body takes tens of milliseconds of CPU and several times its size in
memory, and publishing it as much again: bodies over OFFLOAD_BYTES are parsed in a worker
thread, so the event loop keeps answering, and `large_requests` lets at most
LARGE_AT_ONCE such requests be handled at a time, read to answer, so concurrent large
requests cannot multiply the peak. Small requests never wait for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from casque.sidecar.config import SidecarSettings
from casque.sidecar.errors import InvalidRequest, RequestTimeout, RequestTooLarge, from_validation

M = TypeVar("M", bound=BaseModel)

OFFLOAD_BYTES = 256 * 1024
LARGE_AT_ONCE = 2
CHUNK_BYTES = 64 * 1024

_LARGE = web.AppKey("large_requests", asyncio.Semaphore)


def install(app: web.Application) -> None:
    app[_LARGE] = asyncio.Semaphore(LARGE_AT_ONCE)


def is_large(request: web.Request) -> bool:
    """A body over OFFLOAD_BYTES, or of a length not declared (chunked)."""
    if not request.body_exists:
        return False
    length = request.content_length
    return length is None or length > OFFLOAD_BYTES


@web.middleware
async def large_requests(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
    if not is_large(request):
        return await handler(request)
    async with request.app[_LARGE]:
        return await handler(request)


def too_large(request: web.Request, limit: int) -> RequestTooLarge | None:
    """The refusal for a declared length over the limit, before anything is read."""
    length = request.content_length
    if length is not None and length > limit:
        return RequestTooLarge(f"the body has {length} bytes; this sidecar takes at most {limit} per request")
    return None


async def read_limited(request: web.Request, settings: SidecarSettings) -> bytes:
    refusal = too_large(request, settings.max_request_bytes)
    if refusal is not None:
        raise refusal
    limit = settings.max_request_bytes
    chunks: list[bytes] = []
    size = 0
    content = request.content
    if content.is_eof():
        # The whole body came with the headers, as small requests do: nothing is left to
        # wait for, so no timer is armed and no chunk iterator made (they cost more than
        # the read itself). Whatever arrived still counts against the limit.
        first = content.read_nowait(-1)
        if len(first) > limit:
            raise RequestTooLarge(f"the body passed {limit} bytes, the most this sidecar takes per request")
        if content.at_eof():
            return first
        chunks.append(first)
        size = len(first)
    try:
        async with asyncio.timeout(settings.body_timeout_seconds):
            async for chunk in request.content.iter_chunked(CHUNK_BYTES):
                size += len(chunk)
                if size > limit:
                    raise RequestTooLarge(f"the body passed {limit} bytes, the most this sidecar takes per request")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the body did not arrive within {settings.body_timeout_seconds:g} s ({size} bytes came)"
        ) from None
    return b"".join(chunks)


async def parse_body(request: web.Request, settings: SidecarSettings, model: type[M], optional: bool = False) -> M:
    raw = await read_limited(request, settings)
    if not raw.strip():
        if not optional:
            raise InvalidRequest("the request needs a JSON object body", code="invalid_json")
        raw = b"{}"
    if len(raw) <= OFFLOAD_BYTES:
        return _validate(model, raw)
    return await asyncio.to_thread(_validate, model, raw)


def _validate(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as error:
        raise from_validation(error) from None
