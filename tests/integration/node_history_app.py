"""A publisher and a consumer that run in pods on the test node (in the example worker's image,
with casque-client) and print every call they make as one JSON line, for the history checker
(tests/fixtures/history.py) to judge from the pods' logs.

Times are CLOCK_MONOTONIC, which the pods of one node share with each other and the test
(containers get no time namespace), so windows from different pods compare.

    python3 node_history_app.py publish COUNT RATE [PREFIX [KEYS]]  # ids PREFIXm0.., RATE a second
                                          # at most; with KEYS, message n has the key k<n % KEYS>;
                                          # after a SIGTERM, it stops once the message in hand
                                          # is answered
    python3 node_history_app.py consume [HANDLE]  # receive and ack until killed or, after a SIGTERM,
                                          # the acks of what it holds are answered; HANDLE seconds
                                          # spent on each message before its ack

With $CASQUE_HISTORY_RECORDS (a directory) the lines also go to <it>/<host name>.jsonl, where
they outlive a pod that a Deployment deletes as it scales down.

The publisher gives every message its own producer id, so a retry after a lost answer lands
once (the sidecar's idempotency window); it retries through any outage for as long as it takes.
The consumer keeps going through a sidecar that is killed or backends that are away; an ack
whose answer never came is recorded as `unknown`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from casque_client import Client
from casque_client.errors import ApiError, ClientError

SOURCE = "node-history"
PAUSE = 0.5


RECORDS = os.environ.get("CASQUE_HISTORY_RECORDS")


def record(**fields: object) -> None:
    line = json.dumps(fields)
    print(line, flush=True)
    if RECORDS:
        with open(os.path.join(RECORDS, f"{socket.gethostname()}.jsonl"), "a") as out:
            out.write(line + "\n")


def publish(count: int, rate: float, prefix: str = "", keys: int = 0) -> None:
    # Stopped by the test once its faults are over, so that traffic lasts exactly as long as
    # they do; every id it tried is answered before it exits.
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda number, frame: stopping.append(number))
    published = 0
    with Client(timeout=10.0) as client:
        for number in range(count):
            if stopping:
                break
            # Paced, so that the traffic lasts through the faults the test brings.
            time.sleep(1.0 / rate)
            message_id = f"{prefix}m{number}"
            key = {"key": f"k{number % keys}"} if keys else {}
            while True:
                sent = time.monotonic()
                try:
                    client.publish({"n": number}, id=message_id, source=SOURCE, **key)
                except ClientError as failure:
                    record(op="publish_failed", id=message_id, error=str(failure)[:200])
                    time.sleep(PAUSE)
                    continue
                record(op="published", id=message_id, sent=sent, answered=time.monotonic())
                published += 1
                break
    record(op="published_all", count=published)


def ack(client: Client, receipt: str) -> str:
    try:
        return client.ack(receipt)
    except ApiError as refused:
        return refused.code
    except ClientError:
        return "unknown"


def consume(handle: float = 0.0) -> None:
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
                time.sleep(handle)
                ack_sent = time.monotonic()
                outcome = ack(client, message.receipt)
                record(op="ack", id=message.id, receipt=message.receipt, outcome=outcome, sent=ack_sent,
                       answered=time.monotonic())
    record(op="stopped")


if __name__ == "__main__":
    if sys.argv[1:2] == ["publish"]:
        publish(int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5], *map(int, sys.argv[5:6]))
    elif sys.argv[1:2] == ["consume"]:
        consume(*map(float, sys.argv[2:3]))
    else:
        sys.exit("usage: node_history_app.py publish COUNT RATE [PREFIX [KEYS]] | consume [HANDLE]")
