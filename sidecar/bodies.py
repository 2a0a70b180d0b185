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

Bytes are not the measure of what a body costs once parsed: `[{},{},...]` turns 3 bytes
into an 80-byte dict, so a 4 MiB body of empty objects takes over 100 MiB as Python
objects. A body is charged by its JSON values (a cheap count of the bytes that open or
separate values, made exact outside strings only when the cheap count is too high), and one
with more than `max_json_values` is refused before it is parsed. Each parsed body is
charged its bytes twice (the chunks and their join) and VALUE_BYTES per value, the most a
value was measured to cost through the request models, until its request is answered;
`RequestMemory` keeps the sum and its peak (metrics.py exports both), so what bodies take
is bounded by LARGE_AT_ONCE large ones and can be read from the sidecar itself.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from casque.sidecar.config import SidecarSettings
from casque.sidecar.errors import InvalidRequest, RequestTimeout, RequestTooLarge, TooManyValues, from_validation

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

OFFLOAD_BYTES = 256 * 1024
LARGE_AT_ONCE = 2
CHUNK_BYTES = 64 * 1024

# Measured peak per value through the publish models (tracemalloc): a dict in a list 80 B,
# an object member 106 B, an element of a refused message list 192 B (its error included).
VALUE_BYTES = 200
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)

_LARGE = web.AppKey("large_requests", asyncio.Semaphore)
_CHARGE = web.RequestKey("request_memory", int)


@dataclass
class RequestMemory:
    """Bytes charged to the bodies being parsed or handled now, and the most ever charged."""

    charged: int = 0
    peak: int = 0

    def charge(self, amount: int) -> None:
        self.charged += amount
        self.peak = max(self.peak, self.charged)

    def release(self, amount: int) -> None:
        self.charged -= amount


_MEMORY = web.AppKey("request_memory", RequestMemory)


def install(app: web.Application) -> None:
    app[_LARGE] = asyncio.Semaphore(LARGE_AT_ONCE)
    app[_MEMORY] = RequestMemory()


def memory_of(app: web.Application) -> RequestMemory:
    return app[_MEMORY]


def json_values(raw: bytes, limit: int) -> int:
    """How many JSON values `raw` holds, at most: the top one, and one more for each element or
    member of a container, which is the first one in a non-empty container or follows a comma.
    Counted on the bytes as they are; when that passes `limit`, again with strings emptied,
    as brackets and commas inside strings open nothing."""
    quick = _count(raw)
    return quick if quick <= limit else _count(_STRING.sub(b'""', raw))


def _count(raw: bytes) -> int:
    opened = raw.count(b"{") + raw.count(b"[")
    empty = raw.count(b"{}") + raw.count(b"[]")
    return 1 + raw.count(b",") + opened - empty


def is_large(request: web.Request) -> bool:
    """A body over OFFLOAD_BYTES, or of a length not declared (chunked)."""
    if not request.body_exists:
        return False
    length = request.content_length
    return length is None or length > OFFLOAD_BYTES


@web.middleware
async def large_requests(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
    try:
        if not is_large(request):
            return await handler(request)
        async with request.app[_LARGE]:
            return await handler(request)
    finally:
        charged = request.get(_CHARGE)
        if charged is not None:
            request.app[_MEMORY].release(charged)


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
    raw = await read_json(request, settings, optional)
    return await decode_body(raw, functools.partial(validate, model))


async def read_json(request: web.Request, settings: SidecarSettings, optional: bool = False) -> bytes:
    """A JSON body read within the limits and charged to the request memory, not parsed yet."""
    raw = await read_limited(request, settings)
    if not raw.strip():
        if not optional:
            raise InvalidRequest("the request needs a JSON object body", code="invalid_json")
        raw = b"{}"
    _charge(request, raw, settings.max_json_values)
    return raw


async def decode_body(raw: bytes, decode: Callable[[bytes], T]) -> T:
    """decode(raw), in a worker thread for a body over OFFLOAD_BYTES."""
    if len(raw) <= OFFLOAD_BYTES:
        return decode(raw)
    return await asyncio.to_thread(decode, raw)


def _charge(request: web.Request, raw: bytes, limit: int) -> None:
    # Fewer bytes than the limit cannot hold more values: no count needed.
    values = json_values(raw, limit) if len(raw) > limit else len(raw)
    if values > limit:
        raise TooManyValues(
            f"the body holds {values} JSON values; this sidecar parses at most {limit} per request "
            "(send a large array as data_base64)"
        )
    amount = 2 * len(raw) + values * VALUE_BYTES
    request.app[_MEMORY].charge(amount)
    request[_CHARGE] = request.get(_CHARGE, 0) + amount


def validate(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as error:
        raise from_validation(error) from None
