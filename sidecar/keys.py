"""The typed keys under which the sidecar's app holds its parts (shared by the factory and the routes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from casque.config import Settings
from casque.sidecar.config import SidecarSettings
from casque.sidecar.metrics import SidecarMetrics
from casque.sidecar.runtime import Runtime
from casque.sidecar.tracing import Tracing

SETTINGS = web.AppKey("settings", SidecarSettings)
BACKENDS = web.AppKey("backends", Settings)
METRICS = web.AppKey("metrics", SidecarMetrics)
RUNTIME = web.AppKey("runtime", Runtime)
# The OpenAPI document, made at its first request (it builds every model's JSON schema).
OPENAPI: web.AppKey[Callable[[], dict[str, Any]]] = web.AppKey("openapi")
# None unless an exporter is configured (tracing.py): each operation checks it once.
TRACING: web.AppKey[Tracing | None] = web.AppKey("tracing")
