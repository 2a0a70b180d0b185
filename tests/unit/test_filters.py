"""Subscriber filters: what compiles, what matches, and how a shard's state applies one."""

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from casque.engine.keylocks import KeyLocks
from casque.engine.messages import DEFAULT_EVENT_TYPE, Position, StoredMessage, filter_variables
from casque.engine.shard_state import ShardState
from casque.filters import MAX_FILTER_LENGTH, InvalidFilter, compile_filter
from casque.specs import SubscriberSpec

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
WALL = T0.timestamp()


def message(batch: int, seq: int, key: str | None = None, **attributes: str) -> StoredMessage:
    return StoredMessage(Position(0, batch, seq), f"{batch}-{seq}", T0, b"x", key=key, attributes=attributes)


def variables(stored: StoredMessage, priority: int = 0) -> dict[str, object]:
    return filter_variables(stored, priority, "/casque/ns/orders")


@pytest.mark.parametrize(("expression", "why"), [
    ("regoin == 'eu'", "undeclared reference to 'regoin'"),
    ("priority == 'high'", "no matching overload"),
    ("attributes.region ==", "Syntax error"),
    ("attributes.region", r"must be a condition \(true or false\), not a value of type string"),
    ("priority + 1", r"must be a condition \(true or false\), not a value of type int"),
    ("  ", "must not be empty"),
    ("true || " * 600 + "true", f"at most {MAX_FILTER_LENGTH} characters"),
])
def test_an_expression_that_is_not_a_condition_over_the_variables_is_refused_with_the_checkers_words(
    expression: str, why: str
) -> None:
    with pytest.raises(InvalidFilter, match=why) as refused:
        compile_filter(expression)
    assert "\n" not in str(refused.value) and "INVALID_ARGUMENT" not in str(refused.value)


def test_a_subscriber_spec_with_a_bad_filter_is_refused_and_a_good_one_kept_in_its_znode_form() -> None:
    with pytest.raises(ValidationError, match="undeclared reference to 'region'"):
        SubscriberSpec.model_validate({"queue": "orders", "filter": "region == 'eu'"})
    spec = SubscriberSpec.model_validate({"queue": "orders", "filter": "attributes.region == 'eu'"})
    assert spec.model_dump(by_alias=True, mode="json")["filter"] == "attributes.region == 'eu'"
    # Unset, the field is left out, so sidecars that do not know it still read the subscriber.
    assert "filter" not in SubscriberSpec(queue="orders").model_dump(by_alias=True, mode="json")


def test_attributes_key_priority_and_the_event_fields_are_what_the_app_would_be_delivered() -> None:
    stored = message(1, 0, key="customer-7", region="eu", **{"ce-type": "order.created", "ce-source": "/shop",
                                                              "ce-subject": "o-1", "casque-schema-version": "2"})
    seen = variables(stored, priority=3)
    assert seen == {"attributes": {"region": "eu"}, "key": "customer-7", "priority": 3, "source": "/shop",
                    "eventType": "order.created", "subject": "o-1"}
    bare = variables(message(1, 1))
    assert bare == {"attributes": {}, "key": "", "priority": 0, "source": "/casque/ns/orders",
                    "eventType": DEFAULT_EVENT_TYPE, "subject": ""}
    both = compile_filter('eventType.startsWith("order.") && key == "customer-7" && priority > 2 && source == "/shop"')
    assert both.matches(seen) and not both.matches(bare)


def test_a_filter_on_an_attribute_the_message_lacks_does_not_match_and_has_says_so_explicitly() -> None:
    absent = variables(message(1, 0))
    assert not compile_filter('attributes.region == "eu"').matches(absent)
    assert not compile_filter('attributes.region != "eu"').matches(absent)
    assert compile_filter('!has(attributes.region) || attributes.region != "eu"').matches(absent)


def filtered_state(expression: str, locks: KeyLocks | None = None) -> ShardState:
    program = compile_filter(expression)
    return ShardState(shard=0, offset=1, locks=locks,
                      matches=lambda stored: program.matches(variables(stored)))


def test_messages_the_filter_does_not_match_are_done_uncounted_in_the_limit_and_the_offset_passes_them() -> None:
    state = filtered_state('attributes.region == "eu"')
    state.add_batch(1, [message(1, 0, region="us"), message(1, 1, region="eu"), message(1, 2, region="us")])
    state.add_batch(2, [message(2, 0, region="us"), message(2, 1, region="us")])
    state.add_batch(3, [message(3, 0, region="eu")])
    got = state.take(2, now=0, visibility=30, expired_ttl=WALL)
    assert [h.entry.message.message_id for h in got] == ["1-1", "3-0"]
    assert state.counters.filtered == 4 and state.counters.delivered == 2
    # Batch 2 held nothing the subscriber wants: it is complete without an ack.
    assert 2 not in state.batches
    for handout in got:
        state.ack(handout.entry.message.position, handout.nonce)
    assert state.advance_offset() == 4 and state.loaded_messages == 0


def test_a_filtered_message_does_not_wait_behind_its_keys_message_in_flight() -> None:
    locks = KeyLocks()
    state = filtered_state('attributes.kind == "bill"', locks)
    state.add_batch(1, [message(1, 0, key="k", kind="bill"), message(1, 1, key="k", kind="audit"),
                        message(1, 2, key="k", kind="bill")])
    first = state.take(10, now=0, visibility=30, expired_ttl=WALL)
    assert [h.entry.message.message_id for h in first] == ["1-0"]
    assert state.counters.filtered == 1  # 1-1 went, though 1-0 of its key is in flight; 1-2 still waits
    state.ack(first[0].entry.message.position, first[0].nonce)
    assert [h.entry.message.message_id for h in state.take(10, 0, 30, WALL)] == ["1-2"]


def test_a_changed_filter_applies_to_every_message_not_yet_delivered_not_to_one_in_flight() -> None:
    current = {"expression": 'attributes.region == "eu"'}
    state = ShardState(shard=0, offset=1,
                       matches=lambda stored: compile_filter(current["expression"]).matches(variables(stored)))
    state.add_batch(1, [message(1, 0, region="eu"), message(1, 1, region="us"), message(1, 2, region="us")])
    in_flight = state.take(1, now=0, visibility=30, expired_ttl=WALL)
    assert [h.entry.message.message_id for h in in_flight] == ["1-0"]
    current["expression"] = 'attributes.region == "us"'
    # The delivery in flight stays the app's to settle; the rest meet the new filter.
    assert [h.entry.message.message_id for h in state.take(10, 0, 30, WALL)] == ["1-1", "1-2"]
    state.nack(in_flight[0].entry.message.position, in_flight[0].nonce, None, now=1)
    assert state.take(10, 1, 30, WALL) == [] and state.counters.filtered == 1
