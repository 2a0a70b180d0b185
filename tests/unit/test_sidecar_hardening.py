"""The sidecar's limits, refusals and error mapping as pure functions: no server, no backends."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import pytest
from aiohttp.test_utils import make_mocked_request
from cassandra import OperationTimedOut, ReadTimeout
from cassandra.cluster import NoHostAvailable
from cassandra.protocol import ServerError
from kazoo.exceptions import ConnectionLoss, NoAuthError, NoNodeError, SessionExpiredError
from pydantic import ValidationError

from casque.engine.idempotency import RecentIds
from casque.engine.messages import Delivery, Position, Published, StoredMessage
from casque.engine.entries import ByteBudget
from casque.engine.shard_state import ShardState
from casque.errors import AccessDenied, BackendUnavailable, QueueNotFound
from casque.instants import FIRST_INSTANT, LAST_INSTANT
from casque.schema import QueueRef
from casque.sidecar.config import SidecarSettings
from casque.sidecar.errors import as_casque_error, status_of
from casque.sidecar.guards import host_name, is_open
from casque.sidecar.bodies import VALUE_BYTES, json_values
from casque.sidecar.models.publishing import PublishBatchRequest, PublishMessage
from casque.sidecar.models.receiving import SeekRequest
from casque.sidecar.rendering import message_json, receive_body
from casque_client.loopback import is_loopback

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
QUEUE = QueueRef("default", "orders")


def stored(seq: int, payload: bytes, content_type: str | None = "application/json") -> StoredMessage:
    return StoredMessage(Position(0, 1, seq), f"m{seq}", T0, payload, content_type=content_type)


# --- receive byte budget ---------------------------------------------------------------------------
def test_a_byte_budget_stops_a_take_at_the_first_message_that_does_not_fit() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, [stored(s, b"x" * size) for s, size in enumerate([400, 400, 400, 10])])
    budget = ByteBudget(1000)
    first = state.take(10, 0.0, 30.0, T0.timestamp(), budget=budget)
    assert [h.entry.message.message_id for h in first] == ["m0", "m1"]  # order kept: m3 would fit, m2 first
    assert state.ready_count == 2
    later = state.take(10, 0.0, 30.0, T0.timestamp(), budget=ByteBudget(1000))
    assert [h.entry.message.message_id for h in later] == ["m2", "m3"]


def test_a_message_larger_than_the_budget_still_goes_alone() -> None:
    state = ShardState(shard=0, offset=1)
    state.add_batch(1, [stored(0, b"x" * 5000), stored(1, b"y")])
    taken = state.take(10, 0.0, 30.0, T0.timestamp(), budget=ByteBudget(1000))
    assert [h.entry.message.message_id for h in taken] == ["m0"]


# --- poison isolation ------------------------------------------------------------------------------
@pytest.mark.parametrize("payload", [b"[" * 50_000 + b"]" * 50_000, b'{"a": ', b"[NaN]", b"Infinity", b"\xff"])
def test_a_payload_not_renderable_as_json_is_delivered_as_base64(payload: bytes) -> None:
    good = Delivery(stored(0, b'{"ok": 1}'), "r0", 1, 0.0)
    bad = Delivery(stored(1, payload), "r1", 1, 0.0)
    body = json.loads(receive_body([good, bad], QUEUE))  # the whole answer is strict JSON
    first, second = body["messages"]
    assert first["data"] == {"ok": 1}
    assert "data" not in second and base64.b64decode(second["data_base64"]) == payload
    assert second["datacontenttype"] == "application/json"


def test_each_message_renders_as_strict_json() -> None:
    rendered = message_json(Delivery(stored(0, b'{"n": 1.5}'), "r0", 2, 0.0), QUEUE)
    assert json.loads(rendered, parse_constant=lambda name: pytest.fail(name))["deliverycount"] == 2


@pytest.mark.parametrize(("stored_time", "field"), [("not a time", None), ("2026-02-03T04:05:06Z", "2026-02-03T04:05:06Z"),
                                                  ("0001-01-01T00:30:58+05:30", "0001-01-01T00:30:58+05:30")])
def test_a_stored_ce_time_that_is_no_time_stays_an_attribute(stored_time: str, field: str | None) -> None:
    message = stored(0, b'{"ok": 1}')
    message = dataclasses.replace(message, attributes={"ce-time": stored_time})
    rendered = json.loads(message_json(Delivery(message, "r0", 1, 0.0), QUEUE))
    assert rendered["data"] == {"ok": 1}
    if field is None:
        assert rendered["attributes"] == {"ce-time": stored_time}
        assert rendered["time"] == "2026-01-01T00:00:00Z"  # when casque wrote it
    else:
        assert (rendered["time"], rendered["attributes"]) == (field, {})


@pytest.mark.parametrize("body", [b'{"data": NaN}', b'{"data": {"x": [Infinity]}}', b'{"data": -Infinity}',
                                  b'{"data": 1e999}'])
def test_non_finite_numbers_are_refused_at_publish(body: bytes) -> None:
    with pytest.raises(ValidationError, match="NaN or Infinity"):
        PublishMessage.model_validate_json(body, strict=True)


def test_text_data_with_a_text_content_type_is_still_taken() -> None:
    message = PublishMessage.model_validate_json(b'{"data": "NaN", "datacontenttype": "text/plain"}', strict=True)
    assert message.outgoing().payload == b"NaN"


@pytest.mark.parametrize(("moment", "edge"), [("9999-12-31T23:59:59-23:59", LAST_INSTANT),
                                               ("0001-01-01T00:30:58+05:30", FIRST_INSTANT)])
def test_times_that_utc_cannot_express_stand_for_the_last_or_first_instant(moment: str, edge: datetime) -> None:
    assert SeekRequest.model_validate_json(json.dumps({"time": moment}), strict=True).time == edge
    assert PublishMessage.model_validate_json(json.dumps({"deliverAt": moment}), strict=True).deliver_at == edge


def test_an_event_time_that_utc_cannot_express_is_kept_in_its_own_offset() -> None:
    message = PublishMessage.model_validate_json(b'{"time": "0001-01-01T00:30:58+05:30"}', strict=True)
    assert message.outgoing().attributes["ce-time"] == "0001-01-01T00:30:58+05:30"
    message = PublishMessage.model_validate_json(b'{"time": "2026-01-01T12:00:00+01:00"}', strict=True)
    assert message.outgoing().attributes["ce-time"] == "2026-01-01T11:00:00Z"


# --- error mapping ---------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [
    OperationTimedOut("no answer"),
    NoHostAvailable("none", {}),
    ReadTimeout("slow", consistency=1, required_responses=1, received_responses=0, data_retrieved=False),
    ServerError(code=0, message="boom", info=None),
    ConnectionLoss(),
    SessionExpiredError(),
    NoNodeError(),
])
def test_every_backend_failure_is_a_retryable_503(error: BaseException) -> None:
    mapped = as_casque_error(error)
    assert isinstance(mapped, BackendUnavailable)
    assert status_of(mapped) == 503


def test_a_zookeeper_refusal_of_the_sidecars_identity_is_a_403_not_a_retryable_503() -> None:
    mapped = as_casque_error(NoAuthError())
    assert isinstance(mapped, AccessDenied) and status_of(mapped) == 403


def test_casque_errors_keep_their_status_and_our_own_faults_stay_unmapped() -> None:
    assert status_of(as_casque_error(QueueNotFound("x"))) == 404  # type: ignore[arg-type]
    assert as_casque_error(ValueError("a bug")) is None


# --- tokens and hosts ------------------------------------------------------------------------------
@pytest.mark.parametrize("token", ["", "   "])
def test_an_empty_token_is_refused(token: str) -> None:
    with pytest.raises(ValidationError, match="token is empty"):
        SidecarSettings(token=token)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.7", "::", "pod.example"])
def test_a_bind_beyond_the_loopback_needs_a_long_token(host: str) -> None:
    with pytest.raises(ValidationError, match="at least 32 bytes"):
        SidecarSettings(host=host)
    with pytest.raises(ValidationError, match="at least 32 bytes"):
        SidecarSettings(host=host, token="x" * 31)
    assert SidecarSettings(host=host, token="x" * 32).token is not None


def test_a_loopback_bind_may_go_without_a_token() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert SidecarSettings(host=host).token is None


def test_a_token_file_is_read_without_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s" * 40 + "\n")
    settings = SidecarSettings(token_file=path, host="0.0.0.0")
    assert settings.token is not None and settings.token.get_secret_value() == "s" * 40
    with pytest.raises(ValidationError, match="not both"):
        SidecarSettings(token_file=path, token="t" * 40)
    with pytest.raises(ValidationError, match="cannot read the token file"):
        SidecarSettings(token_file=tmp_path / "missing")


@pytest.mark.parametrize("header, name", [
    ("127.0.0.1:8717", "127.0.0.1"), ("localhost", "localhost"), ("[::1]:8717", "::1"), ("::1", "::1"),
    ("evil.example:80", "evil.example"), ("", ""),
])
def test_host_names_are_read_without_their_port(header: str, name: str) -> None:
    assert host_name(header) == name


def test_only_loopback_names_count_as_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.1.2.3", "evil.example", "localhost.evil.example", ""))


# --- the dedup cache ------------------------------------------------------------------------------
def test_recent_ids_are_bounded_by_bytes_as_well_as_by_count() -> None:
    recent = RecentIds(ids=1000, max_bytes=10_000)
    for n in range(1000):
        recent.remember(f"{n:0>200}", Published(f"m{n}", 0, 1, n))
    assert recent.bytes <= 10_000 and 0 < len(recent) < 1000
    newest = f"{999:0>200}"
    assert recent.get(newest) is not None and recent.get(f"{0:0>200}") is None  # the oldest went first
    small = RecentIds(ids=3, max_bytes=10**9)
    for n in range(5):
        small.remember(str(n), Published(f"m{n}", 0, 1, n))
    assert [small.get(str(n)) is not None for n in range(5)] == [False, False, True, True, True]


@pytest.mark.parametrize("id_length", [8, 250])
def test_the_id_memorys_count_of_its_bytes_is_not_below_what_it_holds(id_length: int) -> None:
    """Its byte bound (REMEMBERED_BYTES) is a bound on the memory only if each remembered id
    is charged at least what it holds: the strings, the dict's entry, the result, the time."""
    recent = RecentIds(ids=10**9, max_bytes=10**12)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(5000):
            recent.remember(f"\x00source\x00{n:0>{id_length}}", Published(f"{n:032x}", 3, 100_000 + n, n % 100))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert recent.bytes >= held * 0.95, (recent.bytes / 5000, held / 5000)


# --- bodies charged by their JSON values ------------------------------------------------------------
@pytest.mark.parametrize(("body", "values"), [
    (b"{}", 1), (b"[]", 1), (b"1", 1), (b'"a,b[{"', 1), (b"[1,2,3]", 4), (b"[{},[],{}]", 4),
    (b'{"a": 1, "b": [1, {"c": []}]}', 6), (b'{"csv": "' + b"a,b,c," * 1000 + b'"}', 2),
])
def test_json_values_are_counted_outside_strings(body: bytes, values: int) -> None:
    assert json_values(body, limit=0) == values  # limit 0: always the exact count
    assert json_values(body, limit=10**9) >= values  # the quick count never says fewer


SHAPES = {
    "empty objects": b'{"data": [' + b",".join([b"{}"] * 50_000) + b"]}",
    "empty lists": b'{"data": [' + b",".join([b"[]"] * 50_000) + b"]}",
    "members": b'{"data": {' + b",".join(b'"k%d": 1' % i for i in range(50_000)) + b"}}",
    "floats": b'{"data": [' + b",".join([b"1.5"] * 50_000) + b"]}",
    "short strings": b'{"data": [' + b",".join([b'"a"'] * 50_000) + b"]}",
    "refused messages": b'{"messages": [' + b",".join([b'{"x": 1}'] * 50_000) + b"]}",
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_bodys_charge_covers_what_parsing_it_takes(shape: str) -> None:
    raw = SHAPES[shape]
    tracemalloc.start()
    try:
        with contextlib.suppress(ValidationError):
            PublishBatchRequest.model_validate_json(raw, strict=True) if shape == "refused messages" \
                else PublishMessage.model_validate_json(raw, strict=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= json_values(raw, limit=0) * VALUE_BYTES, (shape, peak)


def test_recent_ids_are_forgotten_once_the_window_has_passed_since_their_publish_began() -> None:
    recent = RecentIds(window_seconds=10)
    recent.remember("fresh", Published("m1", 0, 1, 0), started=time.monotonic() - 9)
    recent.remember("stale", Published("m2", 0, 1, 1), started=time.monotonic() - 10)
    # Past the window its rows have expired too: a retry is a new message, not a duplicate.
    assert recent.get("fresh") is not None and recent.get("stale") is None


@pytest.mark.parametrize(("ports", "clash"), [
    ({"port": 9719, "health_port": 9719}, "the API port and the health port are both 9719"),
    ({"metrics_port": 9718, "health_port": 9718}, "the metrics port and the health port are both 9718"),
    ({"port": 9718, "metrics_port": 9718}, "the API port and the metrics port are both 9718"),
])
def test_the_api_metrics_and_health_ports_must_differ(ports: dict[str, int], clash: str) -> None:
    with pytest.raises(ValidationError, match=clash):
        SidecarSettings(**ports)  # type: ignore[arg-type]
    SidecarSettings(port=0, metrics_port=0, health_port=0)  # each a free port of its own


# --- the paths open to probes and scrapers ------------------------------------------------------
@pytest.mark.parametrize(("target", "open_"), [
    ("/healthz", True), ("/readyz?verbose=1", True), ("/%6Detrics", True), ("/openapi.json", True),
    ("/v1/queues/q/messages", False), ("/healthz/", False), ("/healthz%2Fx", False), ("/metrics2", False),
])
def test_a_path_is_open_as_the_router_reads_it(target: str, open_: bool) -> None:
    assert is_open(make_mocked_request("GET", target)) is open_
