"""Effectively-once pipelines: an ack that publishes the messages its input resulted in.

The outputs of an input message get idempotency keys derived from the subscriber (its
incarnation), the input's message id and each output's index, and are published before the
input is acked. A crash anywhere in between leaves the input to be delivered again; the app
does its work again and acks with the same outputs, which are then answered as duplicates of
the first publish (nothing is written twice), and the input is acked. So each output is
published exactly once per input and subscriber, whatever the interleaving.

That holds as long as the target queue remembers the keys: they are kept for the input
queue's retention (not the target's deduplication window), the longest any delivery of the
input can come after the first, a seek back included. A replay after a seek therefore
publishes nothing again either: its outputs are answered as the duplicates they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from casque.engine.messages import OutgoingMessage

PIPELINE_CLIENT_ID_PREFIX = "pipe/"


def output_client_id(subscriber_key: str, input_message_id: str, index: int) -> str:
    """`subscriber_key`: the subscriber's incarnation key (SubscriberState.ack_key), so a
    subscriber deleted and created again under its name publishes anew."""
    return f"{PIPELINE_CLIENT_ID_PREFIX}{subscriber_key}/{input_message_id}/{index}"


def keyed_outputs(outputs: Sequence[OutgoingMessage], subscriber_key: str, input_message_id: str,
                  input_retention_seconds: int) -> list[OutgoingMessage]:
    """The outputs with their derived keys, remembered for the input queue's retention."""
    return [
        dataclasses.replace(output, client_id=output_client_id(subscriber_key, input_message_id, index),
                            client_id_window_seconds=input_retention_seconds)
        for index, output in enumerate(outputs)
    ]
