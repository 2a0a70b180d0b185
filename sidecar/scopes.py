"""Scopes: which queues a pod may publish to, and which subscribers it may consume for.

A pod declares them (annotations `casque.io/publish-scope` and `casque.io/subscribe-scope`,
passed on by the webhook as CASQUE_SIDECAR_PUBLISH_SCOPE and ..._SUBSCRIBE_SCOPE). A scope
that is not set restricts nothing; a scope set to an empty list allows nothing. The
sidecar's credentials reach every queue of the namespace, so without scopes any app in any
pod could publish to, or seek back, every queue there.

Entries: queue names for publishing; `queue/subscriber` for subscribing, where
`queue/*` stands for every subscriber of that queue. The check runs before the body is read
and before the handler, for the operations the route table marks with a scope.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from aiohttp.typedefs import Middleware

from casque.sidecar.errors import OutOfScope

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Scope = Literal["publish", "subscribe"]
ANY_SUBSCRIBER = "*"


@dataclass(frozen=True)
class Scopes:
    """None: unrestricted. A set: exactly these (and nothing when empty)."""

    publish: frozenset[str] | None = None
    subscribe: frozenset[str] | None = None

    @classmethod
    def of(cls, publish: Collection[str] | None, subscribe: Collection[str] | None) -> Scopes:
        return cls(None if publish is None else frozenset(publish), None if subscribe is None else frozenset(subscribe))

    def may_publish(self, queue: str) -> bool:
        return self.publish is None or queue in self.publish

    def may_subscribe(self, queue: str, subscriber: str) -> bool:
        if self.subscribe is None:
            return True
        return f"{queue}/{subscriber}" in self.subscribe or f"{queue}/{ANY_SUBSCRIBER}" in self.subscribe

    def check(self, scope: Scope, queue: str, subscriber: str | None = None) -> None:
        """Raise OutOfScope when this pod may not do `scope` on the queue (or subscriber)."""
        if scope == "publish":
            if not self.may_publish(queue):
                raise OutOfScope(f"this pod may not publish to queue {queue!r} (its publish scope: "
                                 f"{_listed(self.publish)})")
            return
        assert subscriber is not None
        if not self.may_subscribe(queue, subscriber):
            raise OutOfScope(f"this pod may not consume or seek {queue}/{subscriber} (its subscribe scope: "
                             f"{_listed(self.subscribe)})")


def _listed(names: frozenset[str] | None) -> str:
    return ", ".join(sorted(names or ())) or "nothing"


def scope_middleware(scopes: Scopes, needs: Mapping[str, Scope]) -> Middleware:
    """Refuse out-of-scope calls; `needs` maps an operationId (the route's name) to its scope."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        scope = needs.get(request.match_info.route.name or "")
        if scope is not None:
            scopes.check(scope, request.match_info["queue"], request.match_info.get("subscriber"))
        return await handler(request)

    return middleware
