"""A client nobody here wrote: openapi-generator's Python client, generated from the live
sidecar's `/openapi.json`, publishes, receives, nacks, acks, and reads a message's history.

What the document says is all it knows: if a field, a form or an answer were missing from
it, or described otherwise than served, the generated models would refuse a request or an
answer here. The generator is told to keep a body's properties beside a `oneOf` of
`required` alone (how the document says "exactly one of"), which it otherwise turns into a
union of the branches. The jar comes from Maven Central (scripts/install-openapi-generator.sh).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store
from tests.fixtures.sidecars import SidecarProcess
from tests.fixtures.waiting import unavailable

QUEUE = "invoices"
SUBSCRIBER = "ledger"
PACKAGE = "casque_generated"


def generator_jar() -> Path:
    home = Path(os.environ.get("CASQUE_CACHE", Path.home() / ".cache" / "casque")) / "openapi-generator"
    jars = sorted(home.glob("openapi-generator-cli-*.jar"))
    if not jars:
        unavailable("openapi-generator is not installed (bash scripts/install-openapi-generator.sh)")
    return jars[-1]


@pytest.fixture
def sidecar(store: Store, start_sidecar: Callable[..., SidecarProcess]) -> SidecarProcess:
    ref = QueueRef("default", QUEUE)
    catalog.apply_queue(store, ref, QueueSpec(shards=1, retention_seconds=3600, consistency="ONE"))
    catalog.apply_subscriber(store, ref, SUBSCRIBER, SubscriberSpec(queue=QUEUE, start_position="earliest"))
    return start_sidecar("--queue", QUEUE, "--subscriber", SUBSCRIBER)


@pytest.fixture
def generated(sidecar: SidecarProcess, tmp_path: Path) -> Iterator[ModuleType]:
    document = tmp_path / "openapi.json"
    with urllib.request.urlopen(f"{sidecar.url}/openapi.json") as answer:
        document.write_bytes(answer.read())
    out = tmp_path / "client"
    made = subprocess.run(
        ["java", "-jar", str(generator_jar()), "generate", "-i", str(document), "-g", "python", "-o", str(out),
         "--package-name", PACKAGE, "--openapi-normalizer", "REMOVE_ANYOF_ONEOF_AND_KEEP_PROPERTIES_ONLY=true"],
        capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-4000:] + made.stderr[-4000:]
    # Its dependencies (pydantic, urllib3, python-dateutil) are casque's too.
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(out))
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]


def test_a_generated_client_publishes_receives_nacks_acks_and_traces_a_message(
    sidecar: SidecarProcess, generated: ModuleType
) -> None:
    client = generated
    with client.ApiClient(client.Configuration(host=sidecar.url)) as api_client:
        api = client.DefaultApi(api_client)
        published = api.publish(QUEUE, client.PublishMessage(data={"invoice": 7}, partitionkey="acme"))
        assert published.duplicate is False
        again = api.publish(QUEUE, client.PublishMessage(data={"invoice": 7}, producerid="billing", producerseq=1))
        retried = api.publish(QUEUE, client.PublishMessage(data={"invoice": 7}, producerid="billing", producerseq=1))
        assert retried.duplicate and retried.message_id == again.message_id

        # A waiting receive answers with what is ready when it wakes: the two messages are two
        # batches, and a loaded machine may wake it between them.
        got: list[Any] = []
        for _ in range(10):
            got += api.receive(QUEUE, SUBSCRIBER, client.ReceiveRequest(max=10, wait=10)).messages
            if len(got) >= 2:
                break
        assert sorted(m.messageid for m in got) == sorted([published.message_id, again.message_id])
        first = next(m for m in got if m.messageid == published.message_id)
        assert first.data == {"invoice": 7} and first.deliverycount == 1
        (nacked,) = api.nack(QUEUE, SUBSCRIBER, client.NackRequest(receipt=first.receipt, delay=0)).results
        assert nacked.status == "nacked"
        (redelivered,) = api.receive(QUEUE, SUBSCRIBER, client.ReceiveRequest(max=1, wait=10)).messages
        assert redelivered.messageid == published.message_id and redelivered.deliverycount == 2
        receipts = [redelivered.receipt, *(m.receipt for m in got if m is not first)]
        acked = api.ack(QUEUE, SUBSCRIBER, client.AckRequest(receipts=receipts)).results
        assert [r.status for r in acked] == ["acked", "acked"]

        history = api.message_history(QUEUE, published.message_id)
        assert history.message_id == published.message_id and history.state == "logged"
        (subscriber,) = history.subscribers
        assert (subscriber.subscriber, subscriber.state, subscriber.deliveries) == (SUBSCRIBER, "acked", 2)
        stats = api.subscriber_stats(QUEUE, SUBSCRIBER)
        assert stats.in_flight == 0

        with pytest.raises(client.ApiException) as refused:  # the document's own error form
            api.seek(QUEUE, SUBSCRIBER, client.SeekRequest(time="2000-01-01T00:00:00Z"))
        assert refused.value.status == 409 and '"position_out_of_range"' in refused.value.body
