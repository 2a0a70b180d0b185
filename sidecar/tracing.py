"""OpenTelemetry spans of the sidecar's publish, receive, ack and push, when an exporter is configured.

The W3C trace context travels with every message whether or not the sidecar traces: it is
an event attribute (models/publishing.py), stored with the message and handed back on receive and
push. This module only adds the sidecar's own spans to those traces:

- publish: a producer span per request, a child of the request's `traceparent` header, or
  of the one message's own trace context. A message without a trace context of its own is
  stored with this span's, so its consumers continue the publisher's trace.
- receive and ack: a consumer span per request, a child of the request's header (the app's
  own span), linked to the trace context of each message received (a receive answers
  messages of many traces; links, not a parent, say which).
- push: a span per message, a child of the message's trace context; the push request's
  `traceparent` header is this span's, so the app's span continues from it.

Tracing is on only when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set and
OTEL_SDK_DISABLED is not true. OpenTelemetry is an optional extra (`casque[tracing]`),
imported only then: with tracing off the app holds None and each operation pays one check.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the optional extra: never imported unless tracing is configured
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

SERVICE_NAME = "casque-sidecar"
# Links recorded on a receive span: a receive of 1,000 messages need not carry 1,000 links.
MAX_LINKS = 128
Kind = Literal["producer", "consumer", "client"]


def configured(environ: Mapping[str, str]) -> bool:
    endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return bool(endpoint) and environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


class Tracing:
    """Spans through one TracerProvider; `shutdown` flushes what is still buffered."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._trace = trace
        self._tracer = provider.get_tracer("casque.sidecar")
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {"producer": trace.SpanKind.PRODUCER, "consumer": trace.SpanKind.CONSUMER,
                       "client": trace.SpanKind.CLIENT}

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        kind: Kind,
        parent: tuple[str | None, str | None] = (None, None),
        attributes: Mapping[str, str | int] | None = None,
    ) -> Iterator[Span]:
        """A span that ends with the block; `parent` is a (traceparent, tracestate) pair.

        Without a parent the span starts a trace of its own: the sidecar's own spans must
        not become children of whatever happened to be current in the event loop's task.
        """
        from opentelemetry.context import Context

        context = self._extract(*parent) if parent[0] is not None else Context()
        with self._tracer.start_as_current_span(
            name, context=context, kind=self._kinds[kind], attributes=dict(attributes or {}),
            record_exception=True, set_status_on_exception=True,
        ) as span:
            yield span

    def link(self, span: Span, context: tuple[str, str | None]) -> None:
        """Link `span` to a message's trace context (ignored past MAX_LINKS, or when malformed)."""
        if len(getattr(span, "links", ())) >= MAX_LINKS:
            return
        span_context = self._trace.get_current_span(self._extract(*context)).get_span_context()
        if span_context.is_valid:
            span.add_link(span_context)

    def context_of(self, span: Span) -> tuple[str, str | None]:
        """The (traceparent, tracestate) that makes a span the parent of what follows."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier["traceparent"], carrier.get("tracestate") or None

    def _extract(self, traceparent: str | None, tracestate: str | None) -> Any:
        carrier = {"traceparent": traceparent or ""}
        if tracestate:
            carrier["tracestate"] = tracestate
        return self._propagator.extract(carrier)

    def shutdown(self) -> None:
        self._provider.shutdown()


def from_environment(environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Tracing as the OTEL_* variables configure it (OTLP over HTTP), or None when they do not."""
    environ = os.environ if environ is None else environ
    if not configured(environ):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        # Configured but not installed: serving matters more than tracing, so say so and go on.
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed (%s); "
                    "install casque[tracing] to export spans. Tracing is off.", error.name)
        return None
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set, are read by Resource.create.
    provider = TracerProvider(resource=Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME",
                                                                                    SERVICE_NAME)}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing: exporting spans over OTLP")
    return Tracing(provider)
