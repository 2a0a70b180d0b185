"""The sidecar API's request and response bodies: validated here, described in the OpenAPI document.

A published and a delivered message have the shape of a CloudEvent in structured JSON
mode (`specversion`, `id`, `source`, `type`, `time`, `datacontenttype`, `data` or
`data_base64`), so apps and tools that speak CloudEvents read them as they are. casque's
own fields are CloudEvents extension attributes (lowercase, no separators): `partitionkey`
(the CloudEvents partitioning extension), `traceparent` and `tracestate` (the distributed
tracing extension), `messageid` (the id casque gave the message), `priority`,
`deliverycount`, `receipt`, `shard`, `batch`, `seq`, `visibleuntil`, `expiresat`, and
`schemaversion` (the version of the queue's schema the message was checked against at
publish, on queues with a schema).
Application attributes travel in `attributes`. Publishing also takes casque's scheduling
fields `delay`, `deliverAt` and `priority`.

The producer's `id`, `source`, `type`, `subject`, `time`, `dataschema` and trace context
are kept in the message's attributes under `ce-` names, which apps cannot use (the
engine's own attributes are `casque-`), and come back as the event's attributes on
receive and push. `id` and `source` together name an event (the CloudEvents rule), so
they are also the idempotency key; see `dedup_key`.

The other bodies use camelCase. Every body refuses unknown fields: a misspelt `delay`
must not publish at once a message that was meant to wait.

One module per part of the API: `base` (limits, field types, `Body`, `Reply`, errors),
`publishing`, `receiving` (receive and seek), `receipts` (ack, nack, extend) and `status`
(stats and health).
"""
