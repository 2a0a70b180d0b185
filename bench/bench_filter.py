"""CPU per message of a subscriber filter: its variables built, its CEL expression evaluated.

A subscriber's filter (`spec.filter`, casque.filters) is compiled once per expression and
evaluated on every message a shard hands out for the subscriber, before the message is
delivered (ShardState.take). This measures what that costs in CPU (process time, so other
load on the machine inflates it little): building the variables from a stored message
(filter_variables), evaluating three representative expressions on them, and the whole path
the shard calls (message_filter: the spec read, the compiled filter looked up, the variables
built, the expression evaluated). No backend is needed.

    .venv/bin/python bench/bench_filter.py [--messages N] [--runs 3] [--json] [--smoke]

Half the messages carry the `region` attribute, one in three of those with a region outside
the listed ones, so that each expression both matches and does not. It takes bench/all.py's
--cassandra and --zookeeper and ignores them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any, cast

from benchlib import Figure, run_in_process

from casque.engine.member import Member, message_filter
from casque.engine.messages import Position, StoredMessage, event_source_of, filter_variables
from casque.filters import build_filter, compile_filter
from casque.specs import PRIORITY_STRIDE, priority_of

NAMESPACE, QUEUE = "shop", "orders"
EXPRESSIONS = {
    "equality": 'attributes.tenant == "acme"',
    "region": 'has(attributes.region) && attributes.region in ["eu", "us"] && priority > 0',
    "event_type": 'eventType.startsWith("order.")',
}


def stored_message(rng: random.Random, index: int) -> StoredMessage:
    """A message as a shard holds it: app attributes, CloudEvents attributes and an engine one."""
    attributes = {
        "tenant": rng.choice(["acme", "globex", "initech"]),
        "channel": rng.choice(["web", "app", "store"]),
        "ce-type": rng.choice(["order.created", "order.paid", "invoice.sent"]),
        "ce-id": f"e-{index}",
        "ce-subject": f"o-{rng.randrange(10**6):06d}",
        "casque-schema-version": "1",
    }
    if index % 2:
        attributes["region"] = rng.choice(["eu", "us", "apac"])
    shard = rng.randrange(3) * PRIORITY_STRIDE + rng.randrange(8)  # priorities 0 to 2
    return StoredMessage(
        position=Position(shard, 1 + index // 100, index % 100),
        message_id=f"m-{index}",
        published_at=datetime.now(timezone.utc),
        payload=b'{"orderId": "o-000001", "total": 42.5}',
        key=f"customer-{rng.randrange(1000)}",
        attributes=attributes,
        content_type="application/json",
    )


def member_with(expression: str) -> Member:
    """What message_filter reads of a member: its queue's name and its subscriber's spec."""
    spec = SimpleNamespace(message_filter=expression)
    member = SimpleNamespace(queue=SimpleNamespace(namespace=NAMESPACE, name=QUEUE),
                             subscriber_state=SimpleNamespace(spec=spec))
    return cast(Member, member)


def cpu_per_call(call: Callable[[Any], object], values: list[Any]) -> float:
    """Process CPU µs per call of `call` over `values`."""
    start = time.process_time()
    for value in values:
        call(value)
    return (time.process_time() - start) / len(values) * 1e6


FIGURES = [
    Figure("variables", "variables from a stored message (filter_variables)", "µs"),
    Figure("eval_equality", 'evaluate attributes.tenant == "acme"', "µs"),
    Figure("eval_region", "evaluate has(attributes.region) && ... in [...] && priority > 0", "µs"),
    Figure("eval_event_type", 'evaluate eventType.startsWith("order.")', "µs"),
    Figure("path_region", "whole path per message (message_filter), the region filter", "µs"),
    Figure("compile_region", "  compile, once per expression", "ms"),
    Figure("matched_region", "  share of messages the region filter matches (context)", "x"),
]


def once(messages: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    stored = [stored_message(rng, i) for i in range(messages)]
    source = event_source_of(NAMESPACE, QUEUE)
    variables = [filter_variables(m, priority_of(m.position.shard), source) for m in stored]
    figures = {"variables": cpu_per_call(lambda m: filter_variables(m, priority_of(m.position.shard), source), stored)}
    for name, expression in EXPRESSIONS.items():
        matches = compile_filter(expression).matches
        figures[f"eval_{name}"] = cpu_per_call(matches, variables)
    region = EXPRESSIONS["region"]
    start = time.process_time()
    build_filter(region)  # past compile_filter's cache, which would time a lookup
    figures["compile_region"] = (time.process_time() - start) * 1e3
    path = message_filter(member_with(region))
    figures["path_region"] = cpu_per_call(path, stored)
    figures["matched_region"] = sum(map(path, stored)) / len(stored)
    return figures


def main() -> None:
    run_in_process("filter", (__doc__ or "").splitlines()[0], lambda messages, run: once(messages, seed=run), FIGURES)

if __name__ == "__main__":
    main()
