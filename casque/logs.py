"""How casque's processes log: plain text lines by default, or one JSON object per line.

JSON logs (`--log-format json`, or CASQUE_LOG_FORMAT=json) are for log collectors: every
line parses on its own, with `time`, `level`, `logger`, `message`, the request id of the
HTTP request being handled (`request_id`, from a contextvar the sidecar sets per request),
the exception when there is one, and the fields a caller passed in `extra=`.

The contextvar lives here rather than in the sidecar so that any line logged while a
request is handled, by the engine or a driver callback in that task included, carries it.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Literal, TextIO

LogFormat = Literal["text", "json"]
LOG_FORMAT_ENV = "CASQUE_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

REQUEST_ID: ContextVar[str | None] = ContextVar("casque_request_id", default=None)

# What every LogRecord has; anything else on a record came from `extra=` and is logged too.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for name, value in vars(record).items():
            if name not in _STANDARD and name not in entry:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # default=str: an `extra` value that JSON has no type for (a path, a datetime) must
        # not turn the line into a logging error.
        return json.dumps(entry, default=str, ensure_ascii=False)


def formatter(log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def configure(log_format: LogFormat = "text", level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Send the root logger's records to stderr in `log_format`, replacing its handlers."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def reformat(log_format: LogFormat) -> None:
    """Give every handler of the root logger the formatter of `log_format` (for handlers a
    framework installed itself, as kopf does)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter(log_format))
