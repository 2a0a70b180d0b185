"""What one sidecar serves and how: read from CASQUE_SIDECAR_* variables, overridden by flags.

The backend connection (Cassandra, ZooKeeper, keyspace) is casque's shared `Settings`
(CASQUE_* variables); these settings say where the sidecar listens, which subscribers it
consumes for, and how it pushes and shuts down.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from casque.engine.stalls import RECEIVE_WAIT_SECONDS
from casque.schema import NAME_PATTERN, is_name
from casque_client.loopback import is_loopback

DEFAULT_PORT = 8717
MiB = 1024 * 1024
# A token guards a sidecar others can reach; shorter than this it can be guessed.
MIN_TOKEN_BYTES = 32
_STATUS_RANGE = re.compile(r"^(\d{3})(?:-(\d{3}))?$")


def parse_statuses(text: str) -> frozenset[int]:
    """HTTP statuses from a list such as '408,425,429,500-599'."""
    statuses: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = _STATUS_RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"{part!r} is not an HTTP status or a range like 500-599")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if not 100 <= low <= high <= 599:
            raise ValueError(f"{part!r} is not a range of HTTP statuses")
        statuses.update(range(low, high + 1))
    return frozenset(statuses)


class SidecarSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CASQUE_SIDECAR_", extra="forbid")

    # Localhost only by default: the API has no transport security, and the app is in the same pod.
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = DEFAULT_PORT
    # /metrics alone on this port of `metrics_host` (the pod's address by default), for
    # Prometheus, which cannot reach 127.0.0.1 inside the pod. Unset: /metrics is served on
    # the API port only.
    metrics_port: Annotated[int | None, Field(ge=0, le=65535)] = None
    metrics_host: str = "0.0.0.0"
    # /healthz and /readyz alone on this port of `health_host` (the pod's address by
    # default), for the kubelet's httpGet probes, which dial the pod's IP and so cannot reach
    # the API on 127.0.0.1. They carry no message data and need no token. Unset: the probes'
    # paths are served on the API port only.
    health_port: Annotated[int | None, Field(ge=0, le=65535)] = None
    health_host: str = "0.0.0.0"
    namespace: Annotated[str, Field(pattern=NAME_PATTERN.pattern)] = "default"
    # The queue whose subscribers this sidecar consumes for. Publishing works to any queue
    # of the namespace, so a publish-only sidecar needs neither.
    queue: Annotated[str | None, Field(pattern=NAME_PATTERN.pattern)] = None
    # Comma-separated in the environment: CASQUE_SIDECAR_SUBSCRIBERS=billing,audit
    subscribers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Allowlists (casque.sidecar.scopes): queues this pod may publish to, and `queue/subscriber`
    # (or `queue/*`) it may receive, settle and seek for. Unset: no restriction; empty: none.
    publish_scope: Annotated[list[str] | None, NoDecode] = None
    subscribe_scope: Annotated[list[str] | None, NoDecode] = None
    # When set, every call but /healthz, /readyz, /metrics and /openapi.json needs
    # `Authorization: Bearer <token>`. From the environment or `token_file` only: a flag
    # would show in `ps` to every user of the node.
    token: SecretStr | None = None
    token_file: Path | None = None
    # On SIGTERM: how long to keep serving acks for messages already handed out, so the
    # app can finish them, before the leases are released to other sidecars.
    drain_seconds: Annotated[float, Field(ge=0, le=3600)] = 20.0
    # Long polls longer than this are cut short: proxies and clients time out idle requests.
    # The default is the wait the stall threshold allows for (casque.engine.stalls).
    max_wait_seconds: Annotated[float, Field(ge=0, le=300)] = RECEIVE_WAIT_SECONDS
    # Checked against Content-Length before a byte is read, and counted while reading a
    # chunked body. A parsed body takes several times its size in memory, and the injected
    # container has 256 MiB.
    max_request_bytes: Annotated[int, Field(ge=64 * 1024, le=64 * MiB)] = 4 * MiB
    # A receive stops adding messages once their payloads reach this (the first message
    # always goes), so one answer cannot grow with `max` times the largest message.
    max_receive_bytes: Annotated[int, Field(ge=64 * 1024, le=64 * MiB)] = 4 * MiB
    # A client that has not sent its whole body by then gets 408: a trickling client must
    # not hold a connection and its buffer forever.
    body_timeout_seconds: Annotated[float, Field(gt=0, le=600)] = 30.0
    # A parsed JSON value costs up to ~200 bytes (bodies.py): 131,072 of them about 26 MiB,
    # however few bytes they were sent in. A body with more is refused (413) unparsed.
    max_json_values: Annotated[int, Field(ge=1024, le=4 * MiB)] = 131_072
    # A connection with no whole request by then (part of the headers, or nothing, since it
    # opened or since its last answer) is closed: headers cannot be trickled to hold it.
    header_timeout_seconds: Annotated[float, Field(gt=0, le=600)] = 15.0
    # One log line per request (method, path, status, time, request id). Off by default:
    # at thousands of requests a second it would be most of the log.
    access_log: bool = False
    # Group commit linger: wait this long for more publishes before writing a batch.
    publish_linger_seconds: Annotated[float, Field(ge=0, le=1)] = 0.0
    # ... and, with no linger set, this long only after a batch that several publishes shared
    # (concurrent publishers): a publish that comes alone is never held. 1 ms took a third
    # off the sidecar's CPU per one-message publish with 32 in flight (docs/performance.md).
    publish_group_linger_seconds: Annotated[float, Field(ge=0, le=1)] = 0.001
    # SIGUSR2 logs a memory report (memory_report.py). With this above 0, allocations are
    # traced too, keeping this many frames each, and each report writes a snapshot to
    # `memory_snapshot_dir` ($TMPDIR or /tmp if unset). Tracing costs CPU and memory on
    # every allocation: for diagnosis only.
    memory_trace_frames: Annotated[int, Field(ge=0, le=64)] = 0
    memory_snapshot_dir: Path | None = None

    # Push delivery: POST each message to this URL (overrides the Subscriber's pushUrl).
    push_url: str | None = None
    # Push URLs must name the loopback (the app in the pod) unless this is set: a Subscriber
    # is written by whoever may edit it, and must not turn the sidecar into a way to send
    # the queue's messages, with the pod's network identity, anywhere in the cluster.
    push_allow_remote: bool = False
    # Sent with every push in the Casque-Push-Token header, so the app can tell a push from
    # the sidecar from any other request to its endpoint. Unset: a random one per start
    # (still sent, but the app can only check it when both containers are given the same).
    push_token: SecretStr | None = None
    push_concurrency: Annotated[int, Field(ge=1, le=1000)] = 8
    push_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # A 2xx acks. A retry status nacks with exponential backoff (connection errors and
    # timeouts too). A drop status dead-letters. Retry wins where the two overlap; a status
    # in neither (1xx, 3xx) is retried.
    push_retry_statuses: Annotated[frozenset[int], NoDecode] = parse_statuses("408,425,429,500-599")
    push_drop_statuses: Annotated[frozenset[int], NoDecode] = parse_statuses("400-499")
    push_backoff_seconds: Annotated[float, Field(gt=0, le=3600)] = 1.0
    push_max_backoff_seconds: Annotated[float, Field(gt=0, le=12 * 3600)] = 300.0

    @field_validator("subscribers", "publish_scope", "subscribe_scope", mode="before")
    @classmethod
    def _split_names(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("subscribers")
    @classmethod
    def _valid_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not is_name(name):
                raise ValueError(f"subscriber name {name!r} must be a DNS label")
        return list(dict.fromkeys(value))

    @field_validator("publish_scope")
    @classmethod
    def _valid_queues(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            if not is_name(name):
                raise ValueError(f"queue name {name!r} must be a DNS label")
        return value

    @field_validator("subscribe_scope")
    @classmethod
    def _valid_subscriptions(cls, value: list[str] | None) -> list[str] | None:
        for entry in value or ():
            queue, _, subscriber = entry.partition("/")
            if not is_name(queue) or not (subscriber == "*" or is_name(subscriber)):
                raise ValueError(f"subscribe scope entry {entry!r} must be queue/subscriber or queue/*")
        return value

    @field_validator("push_retry_statuses", "push_drop_statuses", mode="before")
    @classmethod
    def _statuses(cls, value: object) -> object:
        return parse_statuses(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _subscribers_need_a_queue(self) -> SidecarSettings:
        if self.subscribers and self.queue is None:
            raise ValueError("subscribers need the queue they belong to (CASQUE_SIDECAR_QUEUE or --queue)")
        return self

    @model_validator(mode="after")
    def _token_rules(self) -> SidecarSettings:
        if self.token_file is not None:
            if self.token is not None:
                raise ValueError("give the token either in CASQUE_SIDECAR_TOKEN or in a token file, not both")
            try:
                text = self.token_file.read_text(encoding="utf-8").strip()
            except OSError as error:
                raise ValueError(f"cannot read the token file {self.token_file}: {error.strerror}") from error
            self.token = SecretStr(text)
        if self.token is not None and not self.token.get_secret_value().strip():
            # An empty token would make `Authorization: Bearer ` the password.
            raise ValueError("the token is empty: set a real one, or none for a loopback-only sidecar")
        if not is_loopback(self.host):
            size = len(self.token.get_secret_value().encode()) if self.token is not None else 0
            if size < MIN_TOKEN_BYTES:
                raise ValueError(f"listening on {self.host}, beyond the pod's loopback, needs a token of at least "
                                 f"{MIN_TOKEN_BYTES} bytes (CASQUE_SIDECAR_TOKEN or a token file); it has "
                                 f"{'none' if self.token is None else f'{size}'}")
        return self

    @model_validator(mode="after")
    def _distinct_ports(self) -> SidecarSettings:
        named = [("the API", self.port), ("metrics", self.metrics_port), ("health", self.health_port)]
        taken = [(what, port) for what, port in named if port]  # 0: a free port of its own
        for i, (what, port) in enumerate(taken):
            for other, other_port in taken[i + 1:]:
                if port == other_port:
                    raise ValueError(f"the {what} port and the {other} port are both {port}: give each its own")
        return self

    @model_validator(mode="after")
    def _push_rules(self) -> SidecarSettings:
        if self.push_url is not None:
            push_target(self.push_url, self.push_allow_remote)
        if self.push_token is not None and len(self.push_token.get_secret_value().encode()) < MIN_TOKEN_BYTES:
            raise ValueError(f"the push token needs at least {MIN_TOKEN_BYTES} bytes")
        return self

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def push_target(url: str, allow_remote: bool) -> str:
    """`url` if the sidecar may push to it; ValueError saying why not.

    Only a literal loopback address or `localhost` counts as local: a name that merely
    resolves to 127.0.0.1 today can resolve elsewhere tomorrow.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"push URL {url!r} is not an http(s) URL with a host")
    if not allow_remote and not is_loopback(parts.hostname):
        raise ValueError(f"push URL {url!r} is not on the pod's loopback (127.0.0.1, localhost, [::1]); "
                         "set CASQUE_SIDECAR_PUSH_ALLOW_REMOTE=true to push elsewhere")
    return url
