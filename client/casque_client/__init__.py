"""casque's client for apps: the sidecar's HTTP API, and handler-style consuming with `subscribe()`.

It installs on its own (`pip install ./client`, aiohttp its only dependency), so an app
needs none of casque's server-side packages.
"""

from casque_client.client import (
    DEFAULT_URL,
    AsyncClient,
    Client,
    Message,
    Outputs,
    PublishResult,
    ReceiptOutcome,
    RetryPolicy,
    message,
)
from casque_client.errors import ApiError, ClientError, SchemaViolation, SidecarUnreachable
from casque_client.subscription import Backoff, subscribe

__all__ = [
    "DEFAULT_URL",
    "ApiError",
    "AsyncClient",
    "Backoff",
    "Client",
    "ClientError",
    "Message",
    "Outputs",
    "PublishResult",
    "ReceiptOutcome",
    "RetryPolicy",
    "SchemaViolation",
    "SidecarUnreachable",
    "message",
    "subscribe",
]
