"""A publisher and a consumer that run in pods on the test node (in the example worker's image,
with casque-client) and print every call they make as one JSON line, for the history checker
(tests/fixtures/history.py) to judge from the pods' logs.

Times are CLOCK_MONOTONIC, which the pods of one node share with each other and the test
(containers get no time namespace), so windows from different pods compare.

    python3 node_history_app.py publish COUNT RATE [PREFIX]  # ids PREFIXm0.., RATE a second at most
    python3 node_history_app.py consume   # receive and ack until killed or, after a SIGTERM, the acks
                                          # of what it holds are answered

The publisher gives every message its own producer id, so a retry after a lost answer lands
once (the sidecar's idempotency window); it retries through any outage for as long as it takes.
The consumer keeps going through a sidecar that is killed or backends that are away; an ack
whose answer never came is recorded as `unknown`.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from casque_client import Client
from casque_client.errors import ApiError, ClientError

SOURCE = "node-history"
PAUSE = 0.5


def record(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def publish(count: int, rate: float, prefix: str = "") -> None:
    with Client(timeout=10.0) as client:
        for number in range(count):
            # Paced, so that the traffic lasts through the faults the test brings.
            time.sleep(1.0 / rate)
            message_id = f"{prefix}m{number}"
            while True:
                sent = time.monotonic()
                try:
                    client.publish({"n": number}, id=message_id, source=SOURCE)
                except ClientError as failure:
                    record(op="publish_failed", id=message_id, error=str(failure)[:200])
                    time.sleep(PAUSE)
                    continue
                record(op="published", id=message_id, sent=sent, answered=time.monotonic())
                break
    record(op="published_all", count=count)


def ack(client: Client, receipt: str) -> str:
    try:
        return client.ack(receipt)
    except ApiError as refused:
        return refused.code
    except ClientError:
        return "unknown"


def consume() -> None:
    # A member leaving as a rolling update has it leave: it acks what it holds, then exits (and
    # its sidecar, a native one, stops after it). As a container's PID 1 it would ignore the
    # signal without a handler.
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda number, frame: stopping.append(number))
    with Client(timeout=10.0) as client:
        while not stopping:
            sent = time.monotonic()
            try:
                messages = client.receive(max=10, wait=2.0)
            except ClientError as failure:
                record(op="receive_failed", error=str(failure)[:200])
                time.sleep(PAUSE)
                continue
            answered = time.monotonic()
            for message in messages:
                record(op="delivery", id=message.id, receipt=message.receipt, count=message.delivery_count,
                       sent=sent, answered=answered)
            for message in messages:
                ack_sent = time.monotonic()
                outcome = ack(client, message.receipt)
                record(op="ack", id=message.id, receipt=message.receipt, outcome=outcome, sent=ack_sent,
                       answered=time.monotonic())
    record(op="stopped")


if __name__ == "__main__":
    if sys.argv[1:2] == ["publish"]:
        publish(int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5])
    elif sys.argv[1:2] == ["consume"]:
        consume()
    else:
        sys.exit("usage: node_history_app.py publish COUNT RATE [PREFIX] | consume")
