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


class SchemaViolation(ApiError):
    """A published message's data did not match the queue's schema (code schema_violation).

    `path` is a JSON pointer into the data ("" for the whole), `rule` the schema keyword that
    failed (`required`, `maximum`, ...), `schema_version` the version checked against, and
    `index` the message's place in a batch (None for a single publish).
    """

    def __init__(
        self, status: int, message: str, *, path: str, rule: str, schema_version: int | None, index: int | None,
    ) -> None:
        super().__init__(status, "schema_violation", message)
        self.path = path
        self.rule = rule
        self.schema_version = schema_version
        self.index = index


class SidecarUnreachable(ClientError):
    """No answer from the sidecar after every retry."""

    code = "sidecar_unreachable"
