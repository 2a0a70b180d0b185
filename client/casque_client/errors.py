"""The errors the client raises. They stand alone: the client installs without casque itself."""

from __future__ import annotations


class ClientError(Exception):
    """Base of every error the client raises on purpose; `code` is machine-readable."""

    code = "client_error"


class ApiError(ClientError):
    """The sidecar refused a call; `code` is its stable error code (queue_not_found, stale_receipt, ...)."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{message} [{code}, HTTP {status}]")
        self.status = status
        self.code = code
        self.detail = message
        self.retry_after = retry_after


class SidecarUnreachable(ClientError):
    """No answer from the sidecar after every retry."""

    code = "sidecar_unreachable"
