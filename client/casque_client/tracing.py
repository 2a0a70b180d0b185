"""A span around each handler `subscribe()` runs, continuing the trace its message came with.

A message keeps the W3C trace context it was published with (`traceparent`, `tracestate`);
the handler's span is a child of it, so a trace runs from the producer through the sidecar
to the consumer's work, and whatever the handler instruments (its HTTP calls, its database
queries) hangs below. The span is current while the handler runs, in a worker thread too
(asyncio.to_thread carries the context there).

OpenTelemetry is the app's choice, not a dependency of the client: without `opentelemetry-api`
importable no span is made and nothing is imported. With it, spans go to the TracerProvider
given to `subscribe()`, else to the global one the app set up (the API's default does nothing).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from casque_client.client import Message

TRACER_NAME = "casque_client"


@functools.cache
def available() -> bool:
    """Whether the OpenTelemetry API can be imported (checked once)."""
    try:
        import opentelemetry.trace  # noqa: F401
        import opentelemetry.trace.propagation.tracecontext  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def handler_span(message: Message, queue: str | None, subscriber: str | None,
                 tracer_provider: Any = None) -> Iterator[None]:
    """The consumer span of one handler run; nothing without OpenTelemetry.

    An exception from the handler is recorded on the span, which ends with an error status,
    and goes on to the caller (which nacks the message).
    """
    if not available():
        yield
        return
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {name: value for name, value in (("traceparent", message.traceparent),
                                               ("tracestate", message.tracestate)) if value}
    # Without a trace context of its own the message starts a trace: the handler's span must
    # not become a child of whatever span the receive loop's task happened to have current.
    parent = TraceContextTextMapPropagator().extract(carrier)
    attributes: dict[str, str | int] = {
        "messaging.system": "casque",
        "messaging.operation.type": "process",
        "messaging.message.id": message.id,
        "messaging.casque.delivery_count": message.delivery_count,
        "messaging.destination.partition.id": str(message.shard),
    }
    if queue:
        attributes["messaging.destination.name"] = queue
    if subscriber:
        attributes["messaging.consumer.group.name"] = subscriber
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
    with tracer.start_as_current_span(f"process {queue or 'casque'}", context=parent, kind=trace.SpanKind.CONSUMER,
                                      attributes=attributes, record_exception=True, set_status_on_exception=True):
        yield
