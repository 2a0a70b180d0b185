"""The app client's former home, kept so that `from casque.client import ...` goes on working.

The client is its own distribution now (`client/`, import name `casque_client`), so that an
app can install it without casque's server-side dependencies; casque requires it.
"""

from casque_client import (
    DEFAULT_URL,
    ApiError,
    AsyncClient,
    Backoff,
    Client,
    ClientError,
    Message,
    PublishResult,
    ReceiptOutcome,
    RetryPolicy,
    SidecarUnreachable,
    message,
    subscribe,
)

__all__ = [
    "DEFAULT_URL",
    "ApiError",
    "AsyncClient",
    "Backoff",
    "Client",
    "ClientError",
    "Message",
    "PublishResult",
    "ReceiptOutcome",
    "RetryPolicy",
    "SidecarUnreachable",
    "message",
    "subscribe",
]
