"""Optional bearer token: when the sidecar has one, API calls must present it.

The sidecar listens on localhost, so the token guards against other processes of the pod
(or of the node, with host networking), not against the network. Probes, metrics and the
OpenAPI document carry no message data and stay open, so kubelet and Prometheus need no
secret.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Middleware

from casque.sidecar.errors import Unauthorized
from casque.sidecar.guards import Handler, is_open


def bearer_middleware(token: str) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_open(request):
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            # Constant time, so the answer's timing does not reveal how much of a guess was right.
            if not hmac.compare_digest(given, expected):
                raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>)")
        return await handler(request)

    return middleware
