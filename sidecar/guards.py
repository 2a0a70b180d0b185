"""What every request must satisfy before its handler runs, checked in this order.

- Host names the loopback (when the sidecar listens only there). A web page can rebind its
  own domain name to 127.0.0.1 and then talk to a developer's local sidecar as a
  same-origin page; its requests still carry that domain in Host, so they are refused (421).
- No Origin other than the loopback's. Browsers put the page's Origin on every POST they
  send, cross-site "simple" requests (text/plain, no preflight) included; apps in the pod
  send none (403).
- A body comes as `Content-Type: application/json` (or a CloudEvents JSON type). A page
  cannot send those cross-site without a CORS preflight, which the sidecar never grants
  (415). A POST without a body (a receive with the defaults) needs none; from a page it
  carries an Origin. A CloudEvent in binary mode may have any content type, but it needs
  the `ce-specversion` header, which a page cannot send cross-site without a preflight either.
- A declared Content-Length within the limit, refused before a byte of the body is read (413).
- Headers of at most MAX_HEADER_BYTES together (431). The HTTP parser already caps their
  count (MAX_HEADERS) and each one's size (8 KiB), so this bounds what a request's headers
  hold at the size of a few big tokens, and a connection at MAX_HEADERS of 8 KiB.

Probes, metrics and the OpenAPI document carry no message data and only answer GETs, so
they skip the Host check: kubelet and Prometheus may name the pod's IP.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from casque.sidecar.bodies import too_large
from casque.sidecar.config import SidecarSettings
from casque.sidecar.errors import CrossOrigin, ForeignHost, HeadersTooLarge, UnsupportedMediaType
from casque.sidecar.events import CLOUDEVENTS_BATCH, CLOUDEVENTS_JSON, is_binary
from casque_client.loopback import is_loopback

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Probes, metrics and the OpenAPI document carry no message data: kubelet and Prometheus
# reach them by the pod's address, with no token.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})
JSON_MEDIA_TYPES = frozenset({"application/json", CLOUDEVENTS_JSON, CLOUDEVENTS_BATCH})
MAX_HEADERS = 32  # given to the HTTP parser (server.py); apps send fewer than ten
MAX_HEADER_BYTES = 32 * 1024
# Fewer headers than this cannot reach MAX_HEADER_BYTES (8 KiB each at most): not summed.
_SUMMED_FROM = MAX_HEADER_BYTES // 8190 + 1


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8717" -> "::1")."""
    host = host_header.strip()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# Apps send the same Host on every request; parsing it as an address each time cost more
# than the rest of the checks together. Bounded, so varied headers cannot grow it.
@functools.lru_cache(maxsize=256)
def loopback_host(host_header: str) -> bool:
    return is_loopback(host_name(host_header))


def is_open(request: web.Request) -> bool:
    """Whether the request is for one of the OPEN_PATHS, as the router decoded its path (kept
    from routing: `request.path` would decode it once more, per request)."""
    return request.rel_url.path_safe in OPEN_PATHS


def check(request: web.Request, settings: SidecarSettings, loopback_only: bool) -> None:
    """Raise the refusal for a request that must not reach its handler."""
    raw = request.raw_headers
    if len(raw) >= _SUMMED_FROM:
        size = sum(len(name) + len(value) for name, value in raw)
        if size > MAX_HEADER_BYTES:
            raise HeadersTooLarge(f"the headers hold {size} bytes; this sidecar takes at most {MAX_HEADER_BYTES}")
    if loopback_only and not is_open(request):
        host = request.headers.get("Host", "")
        if not loopback_host(host):
            raise ForeignHost(f"Host {host[:100]!r} is not this sidecar: call it as 127.0.0.1 or localhost")
    origin = request.headers.get("Origin")
    if origin is not None and not is_loopback(urlsplit(origin).hostname or ""):
        raise CrossOrigin(f"requests from web pages ({origin[:100]}) are refused; the API is for the pod's app")
    if request.body_exists and not is_binary(request.headers):
        media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media not in JSON_MEDIA_TYPES:
            raise UnsupportedMediaType(
                f"the body must be sent as Content-Type: application/json, or as a CloudEvent in binary mode "
                f"with ce-specversion (got {media[:100] or 'none'})"
            )
    refusal = too_large(request, settings.max_request_bytes)
    if refusal is not None:
        raise refusal


def guard_middleware(settings: SidecarSettings) -> Middleware:
    # A sidecar bound beyond the loopback has a long token (config.py), which a page cannot know.
    loopback_only = is_loopback(settings.host)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        check(request, settings, loopback_only)
        return await handler(request)

    return middleware
