"""The benchmarks' HTTP client: JSON requests over a pool of keep-alive HTTP/1.1 connections.

The sidecar benchmark measures the sidecar, but its client shares the machine's cores with
it and with Cassandra. aiohttp's client spent about 110 µs of CPU per one-message publish
here, against some 40 µs for this one, and that CPU came out of what the sidecar and
Cassandra could use. This client does only what the benchmark needs: a request written in
one piece, a response read by its Content-Length (or chunks), the connection kept unless
the server says `Connection: close`. Every response is read in full and its status and JSON
body handed back, so nothing the sidecar answers is skipped.
"""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit


class KeepAliveClient:
    """At most `limit` connections to one `http://host:port`, reused request after request."""

    def __init__(self, url: str, limit: int) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"an http://host:port URL, not {url!r}")
        self._host, self._port = parts.hostname, parts.port
        self._header_host = f"{parts.hostname}:{parts.port}".encode()
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(limit)

    async def __aenter__(self) -> KeepAliveClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        """POST `body` as JSON; the status and the decoded JSON answer."""
        return await self.request("POST", path, json.dumps(body, separators=(",", ":")).encode())

    async def post_ok(self, path: str, body: Any) -> Any:
        """POST `body`; the answer, or the benchmark ends with the status (a bench has no retries)."""
        status, answer = await self.post(path, body)
        if status != 200:
            raise SystemExit(f"{path}: HTTP {status}: {answer}")
        return answer

    async def get(self, path: str) -> tuple[int, Any]:
        return await self.request("GET", path, None)

    async def request(self, method: str, path: str, payload: bytes | None) -> tuple[int, Any]:
        """The status and the decoded JSON answer."""
        status, body = await self.request_raw(method, path, payload)
        return status, json.loads(body) if body else None

    async def request_raw(self, method: str, path: str, payload: bytes | None) -> tuple[int, bytes]:
        """The status and the answer's bytes (a page that is not JSON: /metrics)."""
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode(), path.encode(), self._header_host)
        if payload is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(payload)
        message = head + b"\r\n" + (payload or b"")
        async with self._slots:
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await asyncio.open_connection(self._host, self._port)
            try:
                writer.write(message)
                status, body, keep = await _response(reader)
            except (asyncio.IncompleteReadError, ConnectionResetError) as error:
                writer.close()
                if not reused or (isinstance(error, asyncio.IncompleteReadError) and error.partial):
                    raise
                # The server closed the idle connection (its keep-alive timeout) before it read
                # this request: nothing was handled, so it is sent again on a new connection.
                reader, writer = await asyncio.open_connection(self._host, self._port)
                try:
                    writer.write(message)
                    status, body, keep = await _response(reader)
                except BaseException:
                    writer.close()
                    raise
            except BaseException:
                writer.close()
                raise
            if keep:
                self._idle.append((reader, writer))
            else:
                writer.close()
        return status, body


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """One response: its status, its whole body, and whether the connection may be reused."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head[:-4].split(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    keep = headers.get(b"connection", b"").lower() != b"close"
    if b"content-length" in headers:
        return status, await reader.readexactly(int(headers[b"content-length"])), keep
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        chunks: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            chunk = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return status, b"".join(chunks), keep
            chunks.append(chunk[:-2])
    # Neither: the body runs to the end of the connection.
    return status, await reader.read(), False
