"""Sidecar injection: what a Pod that asks for casque's sidecar gets, as a JSON Patch.

A Pod opts in with annotations (on the Deployment's pod template, usually):

    casque.io/inject: "true"
    casque.io/queue: orders            # the queue whose subscribers the sidecar consumes for
    casque.io/subscriber: billing      # optional; several, comma-separated
    casque.io/port: "8717"             # optional; the sidecar's port on localhost
    casque.io/token-secret: orders-api # optional; a Secret of the namespace with a `token` key
    casque.io/push-token-secret: orders-push  # optional; a Secret with a `push-token` key
    casque.io/publish-scope: orders    # optional; the only queues the pod may publish to
    casque.io/subscribe-scope: orders/billing  # optional; queue/subscriber (or queue/*) it may consume

`plan` turns such a Pod into the patch that adds the sidecar; `review` answers a whole
AdmissionReview with it. Both are pure: a Pod in, a patch out, so the rules are tested
without kopf or an API server. casque.operator.webhook serves them behind kopf's HTTPS
webhook server.

Why the webhook is not a kopf admission handler: kopf runs only on the replica holding the
Lease (see runtime.py), but the webhook Service sends each admission request to any ready
replica, so every replica must answer, leader or not. The patch needs nothing the leader
knows, so each replica serves it from its own settings.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from casque.config import Settings
from casque.errors import InvalidSpec
from casque.operator import metrics
from casque.schema import is_name
from casque.tenancy import namespace_keyspace

log = logging.getLogger(__name__)

ANNOTATION_PREFIX = "casque.io/"
INJECT = f"{ANNOTATION_PREFIX}inject"
QUEUE = f"{ANNOTATION_PREFIX}queue"
SUBSCRIBER = f"{ANNOTATION_PREFIX}subscriber"
PORT = f"{ANNOTATION_PREFIX}port"
TOKEN_SECRET = f"{ANNOTATION_PREFIX}token-secret"
PUSH_TOKEN_SECRET = f"{ANNOTATION_PREFIX}push-token-secret"
PUBLISH_SCOPE = f"{ANNOTATION_PREFIX}publish-scope"
SUBSCRIBE_SCOPE = f"{ANNOTATION_PREFIX}subscribe-scope"

SIDECAR_NAME = "casque-sidecar"
# On every pod that gets the sidecar: the backends' NetworkPolicies admit pods by it, in client
# namespaces only (a pod can set its own labels, not its namespace's).
SIDECAR_LABEL = f"{ANNOTATION_PREFIX}sidecar"
SIDECAR_LABEL_VALUE = "injected"
TMP_VOLUME = "casque-sidecar-tmp"
# Where the operator (the chart's Deployment) and every sidecar mount a backend's TLS Secret,
# `<TLS_MOUNT>/cassandra` and `<TLS_MOUNT>/zookeeper`, and the Secret's keys: the ones
# cert-manager writes.
TLS_MOUNT = "/etc/casque/tls"
TLS_CA_KEY = "ca.crt"
TLS_CERT_KEY = "tls.crt"
TLS_KEY_KEY = "tls.key"
# Written into each namespace by the operator (casque.operator.tenancy, which the webhook,
# a lighter module, does not import).
ZOOKEEPER_SECRET = "casque-zookeeper"
# With Cassandra keyspace isolation: the namespace's role (`username`, `password`) and `keyspace`.
# Not `casque-cassandra`, the name the docs give the shared credentials Secret of
# installations without isolation: the operator must never overwrite a Secret of the user's.
CASSANDRA_SECRET = "casque-cassandra-role"
DEFAULT_PORT = 8717  # the sidecar's own default (casque.sidecar.config); the operator may not import it
DEFAULT_METRICS_PORT = 9718
METRICS_PORT_NAME = "casque-metrics"
DEFAULT_HEALTH_PORT = 9719
HEALTH_PORT_NAME = "casque-health"
LOCALHOST = "127.0.0.1"
# The keys read from the Secrets the annotations name. Distinct, so one Secret may hold both.
TOKEN_KEY = "token"
PUSH_TOKEN_KEY = "push-token"
_SECRET_NAME = re.compile(r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$")
# The image's non-root user (Dockerfile.sidecar); Kubernetes needs the number to check runAsNonRoot.
SIDECAR_UID = 10001

_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"


class InvalidInjection(InvalidSpec):
    """A Pod's casque annotations ask for something impossible; the Pod is refused, with this message."""

    code = "invalid_injection"


class InjectionSettings(BaseSettings):
    """The sidecar the webhook adds, from CASQUE_INJECTION_* variables (the chart sets them)."""

    model_config = SettingsConfigDict(env_prefix="CASQUE_INJECTION_")

    image: str = Field(default_factory=lambda: f"casque/sidecar:{version('casque')}", min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    # Kubernetes 1.29+: an init container with restartPolicy Always starts before the app
    # and stops after it, so the app never sees the sidecar missing and can settle its
    # messages while the sidecar drains. False: an ordinary container beside the app.
    native_sidecar: bool = True
    # A Secret that every app namespace holds, with the Cassandra username and password.
    credentials_secret: str | None = Field(default=None, pattern=_SECRET_NAME.pattern)
    username_key: str = "username"
    password_key: str = "password"
    # The sidecar serves /metrics alone on this port of the pod's address, for Prometheus
    # (a PodMonitor, helm metrics.podMonitor); the queue API stays on 127.0.0.1. None: off.
    metrics_port: int | None = Field(default=DEFAULT_METRICS_PORT, ge=1, le=65535)
    # The sidecar serves /healthz and /readyz alone on this port of the pod's address, where
    # the kubelet's httpGet probes reach them (the API listens on 127.0.0.1 only).
    health_port: int = Field(default=DEFAULT_HEALTH_PORT, ge=1, le=65535)
    # Secrets, present in every app namespace like the credentials Secret, with a backend's
    # CA (ca.crt) and, for mutual TLS, the client's certificate and key (tls.crt, tls.key).
    # Used when the operator's own settings turn that backend's TLS on.
    cassandra_tls_secret: str | None = Field(default=None, pattern=_SECRET_NAME.pattern)
    zookeeper_tls_secret: str | None = Field(default=None, pattern=_SECRET_NAME.pattern)
    cpu_request: str = Field(default="50m", pattern=_QUANTITY)
    memory_request: str = Field(default="128Mi", pattern=_QUANTITY)
    # No CPU limit by default: throttling a sidecar delays every publish and ack of its app.
    cpu_limit: str | None = Field(default=None, pattern=_QUANTITY)
    memory_limit: str | None = Field(default="256Mi", pattern=_QUANTITY)

    @field_validator("credentials_secret", "cassandra_tls_secret", "zookeeper_tls_secret", "cpu_limit",
                     "memory_limit", "metrics_port", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        # The chart sets every variable; an empty one means "none" (no Secret, no limit).
        return None if value == "" else value

    @model_validator(mode="after")
    def _distinct_ports(self) -> InjectionSettings:
        if self.health_port == self.metrics_port:
            raise ValueError(f"the sidecar's health and metrics ports are both {self.health_port}: give each its own")
        return self


@dataclass(frozen=True)
class SidecarRequest:
    """What one Pod's annotations ask for."""

    queue: str | None
    subscribers: tuple[str, ...]
    port: int
    token_secret: str | None
    # None: the annotation is absent, no restriction. Empty: present and empty, nothing allowed.
    publish_scope: tuple[str, ...] | None = None
    subscribe_scope: tuple[str, ...] | None = None
    push_token_secret: str | None = None

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"


def wants_sidecar(pod: Mapping[str, Any]) -> bool:
    return str(_annotations(pod).get(INJECT, "")).strip().lower() == "true"


def has_sidecar(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    return any(container.get("name") == SIDECAR_NAME for container in containers)


def parse_request(annotations: Mapping[str, str]) -> SidecarRequest:
    queue = (annotations.get(QUEUE) or "").strip() or None
    subscribers = tuple(dict.fromkeys(s.strip() for s in (annotations.get(SUBSCRIBER) or "").split(",") if s.strip()))
    token_secret = _secret_name(annotations, TOKEN_SECRET)
    push_token_secret = _secret_name(annotations, PUSH_TOKEN_SECRET)
    for what, name in [(QUEUE, queue), *((SUBSCRIBER, s) for s in subscribers)]:
        if name is not None and not is_name(name):
            raise InvalidInjection(f"annotation {what}: {name!r} is not a queue or subscriber name (a DNS label)")
    if subscribers and queue is None:
        raise InvalidInjection(f"annotation {SUBSCRIBER} needs {QUEUE}, the queue the subscribers belong to")
    text = (annotations.get(PORT) or str(DEFAULT_PORT)).strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise InvalidInjection(f"annotation {PORT}: {text!r} is not a port number (1-65535)")
    publish_scope = _names(annotations, PUBLISH_SCOPE)
    for name in publish_scope or ():
        if not is_name(name):
            raise InvalidInjection(f"annotation {PUBLISH_SCOPE}: {name!r} is not a queue name (a DNS label)")
    subscribe_scope = _names(annotations, SUBSCRIBE_SCOPE)
    for entry in subscribe_scope or ():
        scoped_queue, _, subscriber = entry.partition("/")
        if not is_name(scoped_queue) or not (subscriber == "*" or is_name(subscriber)):
            raise InvalidInjection(f"annotation {SUBSCRIBE_SCOPE}: {entry!r} is not queue/subscriber or queue/*")
    if subscribe_scope is not None and queue is not None:
        # The scope says what this pod may consume, yet its sidecar would lease shards and
        # push for these subscribers anyway; messages it hands out by pull the app could not
        # settle: they would sit invisible and come back until dead-lettered.
        allowed = set(subscribe_scope)
        outside = [s for s in subscribers if f"{queue}/{s}" not in allowed and f"{queue}/*" not in allowed]
        if outside:
            listed = ", ".join(f"{queue}/{s}" for s in outside)
            raise InvalidInjection(
                f"annotation {SUBSCRIBER}: the sidecar would consume for {listed}, outside the pod's "
                f"{SUBSCRIBE_SCOPE} ({', '.join(subscribe_scope) or 'empty: nothing'}); add them to the scope, "
                f"or drop them from {SUBSCRIBER}"
            )
    return SidecarRequest(queue=queue, subscribers=subscribers, port=int(text), token_secret=token_secret,
                          publish_scope=publish_scope, subscribe_scope=subscribe_scope,
                          push_token_secret=push_token_secret)


def _secret_name(annotations: Mapping[str, str], key: str) -> str | None:
    name = (annotations.get(key) or "").strip() or None
    if name is not None and not _SECRET_NAME.fullmatch(name):
        raise InvalidInjection(f"annotation {key}: {name!r} is not a Secret name")
    return name


def _names(annotations: Mapping[str, str], key: str) -> tuple[str, ...] | None:
    """A comma-separated annotation; None when it is absent (an empty one is an empty list)."""
    if key not in annotations:
        return None
    return tuple(dict.fromkeys(n.strip() for n in (annotations[key] or "").split(",") if n.strip()))


def plan(pod: Mapping[str, Any], settings: InjectionSettings, backends: Settings,
         namespace: str | None = None) -> list[dict[str, Any]]:
    """The JSON Patch that adds the sidecar to `pod`; empty if it did not ask or already has one.
    `namespace`: the Pod's (the AdmissionReview's; a Pod being created may not name it).

    Raises InvalidInjection when the annotations cannot be honoured.
    """
    if not wants_sidecar(pod) or has_sidecar(pod):
        return []
    request = parse_request(_annotations(pod))
    namespace = namespace or (pod.get("metadata") or {}).get("namespace")
    spec = pod.get("spec") or {}
    containers: list[Mapping[str, Any]] = list(spec.get("containers") or [])
    for container in [*containers, *(spec.get("initContainers") or [])]:
        for port in container.get("ports") or []:
            if port.get("containerPort") == request.port:
                raise InvalidInjection(
                    f"container {container.get('name')!r} uses port {request.port}, the sidecar's; "
                    f"choose another with the annotation {PORT}"
                )
            if settings.metrics_port is not None and port.get("containerPort") == settings.metrics_port:
                raise InvalidInjection(
                    f"container {container.get('name')!r} uses port {settings.metrics_port}, the sidecar's "
                    f"metrics port; the operator's CASQUE_INJECTION_METRICS_PORT (helm sidecar.metricsPort) moves it"
                )
            if port.get("containerPort") == settings.health_port:
                raise InvalidInjection(
                    f"container {container.get('name')!r} uses port {settings.health_port}, the sidecar's "
                    f"health port; the operator's CASQUE_INJECTION_HEALTH_PORT (helm sidecar.healthPort) moves it"
                )
    for own, what in ((settings.metrics_port, "metrics"), (settings.health_port, "health")):
        if request.port == own:
            raise InvalidInjection(f"annotation {PORT}: {request.port} is the sidecar's {what} port; choose another")
    if spec.get("hostNetwork") and request.token_secret is None:
        # With the node's network the sidecar's 127.0.0.1 is the node's: every process and
        # every hostNetwork pod of the node could publish, receive and seek as this app.
        raise InvalidInjection(
            f"the pod uses hostNetwork, so its sidecar would answer every process on the node; "
            f"give it a token with the annotation {TOKEN_SECRET}, or run the pod without hostNetwork"
        )
    tls = tls_volumes(settings, backends)
    for volume in spec.get("volumes") or []:
        if volume.get("name") in (TMP_VOLUME, *(v["name"] for v in tls)):
            raise InvalidInjection(f"the volume name {volume.get('name')!r} is the sidecar's; rename the Pod's volume")

    patch: list[dict[str, Any]] = []
    labels = (pod.get("metadata") or {}).get("labels")
    if labels:
        patch.append(_add(f"/metadata/labels/{_pointer(SIDECAR_LABEL)}", SIDECAR_LABEL_VALUE))
    else:
        patch.append(_add("/metadata/labels", {SIDECAR_LABEL: SIDECAR_LABEL_VALUE}))
    # The app's containers learn where the sidecar is; casque's clients read these variables.
    for index, container in enumerate(containers):
        defined = {env.get("name") for env in container.get("env") or []}
        missing = [env for env in app_env(request) if env["name"] not in defined]
        if not missing:
            continue
        if container.get("env"):
            patch += [_add(f"/spec/containers/{index}/env/-", env) for env in missing]
        else:
            patch.append(_add(f"/spec/containers/{index}/env", missing))
    volumes = [{"name": TMP_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}}, *tls]
    if spec.get("volumes"):
        patch += [_add("/spec/volumes/-", volume) for volume in volumes]
    else:
        patch.append(_add("/spec/volumes", volumes))
    sidecar = sidecar_container(request, settings, backends, namespace)
    if settings.native_sidecar:
        # First among the init containers, so that later ones may use the queue too.
        if spec.get("initContainers"):
            patch.append(_add("/spec/initContainers/0", sidecar))
        else:
            patch.append(_add("/spec/initContainers", [sidecar]))
    else:
        patch.append(_add("/spec/containers/-", sidecar))
    return patch


def app_env(request: SidecarRequest) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "CASQUE_SIDECAR_URL", "value": request.url}]
    if request.queue is not None:
        env.append({"name": "CASQUE_SIDECAR_QUEUE", "value": request.queue})
    if request.subscribers:
        env.append({"name": "CASQUE_SIDECAR_SUBSCRIBERS", "value": ",".join(request.subscribers)})
    if request.token_secret is not None:
        env.append(_secret_env("CASQUE_SIDECAR_TOKEN", request.token_secret, TOKEN_KEY))
    return env


def sidecar_container(request: SidecarRequest, settings: InjectionSettings, backends: Settings,
                      namespace: str | None = None) -> dict[str, Any]:
    """The sidecar's container spec; docs/deploy.md shows it written out by hand."""
    env: list[dict[str, Any]] = [
        {"name": "CASQUE_SIDECAR_HOST", "value": LOCALHOST},
        {"name": "CASQUE_SIDECAR_PORT", "value": str(request.port)},
        {"name": "CASQUE_SIDECAR_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if settings.metrics_port is not None:
        env.append({"name": "CASQUE_SIDECAR_METRICS_PORT", "value": str(settings.metrics_port)})
    env.append({"name": "CASQUE_SIDECAR_HEALTH_PORT", "value": str(settings.health_port)})
    if request.queue is not None:
        env.append({"name": "CASQUE_SIDECAR_QUEUE", "value": request.queue})
    if request.subscribers:
        env.append({"name": "CASQUE_SIDECAR_SUBSCRIBERS", "value": ",".join(request.subscribers)})
    if request.token_secret is not None:
        env.append(_secret_env("CASQUE_SIDECAR_TOKEN", request.token_secret, TOKEN_KEY))
    if request.push_token_secret is not None:
        # Not given to the app: its push endpoint reads the Secret in its own spec (as it
        # likes, env or file), and no casque client needs it.
        env.append(_secret_env("CASQUE_SIDECAR_PUSH_TOKEN", request.push_token_secret, PUSH_TOKEN_KEY))
    # Only the sidecar gets the scopes: they bind the app, which must not be able to widen them.
    if request.publish_scope is not None:
        env.append({"name": "CASQUE_SIDECAR_PUBLISH_SCOPE", "value": ",".join(request.publish_scope)})
    if request.subscribe_scope is not None:
        env.append({"name": "CASQUE_SIDECAR_SUBSCRIBE_SCOPE", "value": ",".join(request.subscribe_scope)})
    # The backends the operator itself uses, so that sidecars and operator agree on them.
    env += [
        {"name": "CASQUE_CASSANDRA_CONTACT_POINTS", "value": ",".join(backends.cassandra_contact_points)},
        {"name": "CASQUE_CASSANDRA_PORT", "value": str(backends.cassandra_port)},
    ]
    if backends.cassandra_local_dc:
        env.append({"name": "CASQUE_CASSANDRA_LOCAL_DC", "value": backends.cassandra_local_dc})
    env += [
        {"name": "CASQUE_KEYSPACE", "value": sidecar_keyspace(backends, namespace)},
        {"name": "CASQUE_CONSISTENCY", "value": backends.consistency},
        {"name": "CASQUE_ZOOKEEPER_HOSTS", "value": backends.zookeeper_hosts},
        {"name": "CASQUE_ZOOKEEPER_ROOT", "value": backends.zookeeper_root},
    ]
    if backends.zookeeper_username is not None:
        # The namespace's own ZooKeeper identity, from the Secret the operator writes with the
        # namespace's first Queue (casque.operator.tenancy); never the operator's.
        env += [
            _secret_env("CASQUE_ZOOKEEPER_USERNAME", ZOOKEEPER_SECRET, "username"),
            _secret_env("CASQUE_ZOOKEEPER_PASSWORD", ZOOKEEPER_SECRET, "password"),
            _secret_env("CASQUE_ZOOKEEPER_ACL", ZOOKEEPER_SECRET, "acl"),
        ]
    if backends.cassandra_isolation == "keyspace":
        # The namespace's own role, from the Secret the operator writes with the namespace's
        # first Queue (casque.operator.tenancy); never the operator's, nor a shared one.
        env += [
            _secret_env("CASQUE_CASSANDRA_USERNAME", CASSANDRA_SECRET, "username"),
            _secret_env("CASQUE_CASSANDRA_PASSWORD", CASSANDRA_SECRET, "password"),
        ]
    elif settings.credentials_secret is not None:
        # A Pod can only refer to Secrets of its own namespace: each app namespace holds a copy.
        env += [
            _secret_env("CASQUE_CASSANDRA_USERNAME", settings.credentials_secret, settings.username_key),
            _secret_env("CASQUE_CASSANDRA_PASSWORD", settings.credentials_secret, settings.password_key),
        ]
    env += tls_env(settings, backends)
    requests = {"cpu": settings.cpu_request, "memory": settings.memory_request}
    limits = {k: v for k, v in (("cpu", settings.cpu_limit), ("memory", settings.memory_limit)) if v is not None}
    container: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "args": ["sidecar"],
        "env": env,
        "ports": [
            *([{"name": METRICS_PORT_NAME, "containerPort": settings.metrics_port, "protocol": "TCP"}]
              if settings.metrics_port is not None else []),
            {"name": HEALTH_PORT_NAME, "containerPort": settings.health_port, "protocol": "TCP"},
        ],
        "resources": {"requests": requests, **({"limits": limits} if limits else {})},
        # The API listens on 127.0.0.1 only, which the kubelet's HTTP probes cannot reach (they
        # dial the Pod's IP), so they ask the health port, which serves nothing else. httpGet
        # costs the container nothing; an exec probe started a Python for every check.
        "startupProbe": _probe("/healthz", period=1, failures=120),
        "livenessProbe": _probe("/healthz", period=10, failures=3),
        "readinessProbe": _probe("/readyz?scope=serving", period=5, failures=2),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
            *({"name": volume["name"], "mountPath": f"{TLS_MOUNT}/{backend}", "readOnly": True}
              for backend, volume in zip(_tls_backends(settings, backends), tls_volumes(settings, backends))),
        ],
    }
    if settings.native_sidecar:
        container["restartPolicy"] = "Always"
    return container


def sidecar_keyspace(backends: Settings, namespace: str | None) -> str:
    """The keyspace the sidecar works in: its namespace's with keyspace isolation, else the installation's."""
    if backends.cassandra_isolation != "keyspace":
        return backends.keyspace
    if not namespace:
        raise InvalidInjection("the pod's namespace is unknown, so its keyspace is too (keyspace isolation is on)")
    try:
        return namespace_keyspace(backends.keyspace, namespace)
    except InvalidSpec as error:
        raise InvalidInjection(str(error)) from error


def _tls_backends(settings: InjectionSettings, backends: Settings) -> list[str]:
    """The backends whose TLS Secret the sidecar mounts: those the operator reaches over TLS
    with a Secret for sidecars."""
    secrets = {"cassandra": settings.cassandra_tls_secret, "zookeeper": settings.zookeeper_tls_secret}
    enabled = {"cassandra": backends.cassandra_tls.enabled, "zookeeper": backends.zookeeper_tls.enabled}
    return [backend for backend in ("cassandra", "zookeeper") if enabled[backend] and secrets[backend]]


def tls_volumes(settings: InjectionSettings, backends: Settings) -> list[dict[str, Any]]:
    secrets = {"cassandra": settings.cassandra_tls_secret, "zookeeper": settings.zookeeper_tls_secret}
    # Read-only, and readable by others than root: the files belong to root (the app's Pod
    # need not set an fsGroup), the sidecar runs as its own user, and only the sidecar
    # container mounts the volume.
    return [{"name": f"casque-sidecar-{backend}-tls",
             "secret": {"secretName": secrets[backend], "defaultMode": 0o444}}
            for backend in _tls_backends(settings, backends)]


def tls_env(settings: InjectionSettings, backends: Settings) -> list[dict[str, Any]]:
    """The sidecar's TLS settings: the operator's own (TLS on or off, hostname checks), with
    the files from the Secret mounted in the Pod."""
    env: list[dict[str, Any]] = []
    mounted = _tls_backends(settings, backends)
    for backend, tls in (("cassandra", backends.cassandra_tls), ("zookeeper", backends.zookeeper_tls)):
        if not tls.enabled:
            continue
        prefix = f"CASQUE_{backend.upper()}_TLS_"
        if backend not in mounted and (tls.ca_file is not None or tls.cert_file is not None):
            # The sidecar would trust other CAs than the operator, or lack its certificate.
            raise InvalidInjection(
                f"the operator reaches {backend} with TLS files, but sidecars have no Secret to read "
                f"them from: set CASQUE_INJECTION_{backend.upper()}_TLS_SECRET ({backend}.tls.secret in the chart)"
            )
        env += [{"name": f"{prefix}ENABLED", "value": "true"},
                {"name": f"{prefix}VERIFY_HOSTNAME", "value": str(tls.verify_hostname).lower()}]
        directory = f"{TLS_MOUNT}/{backend}"
        if tls.ca_file is not None:
            env.append({"name": f"{prefix}CA_FILE", "value": f"{directory}/{TLS_CA_KEY}"})
        if tls.cert_file is not None:
            env += [{"name": f"{prefix}CERT_FILE", "value": f"{directory}/{TLS_CERT_KEY}"},
                    {"name": f"{prefix}KEY_FILE", "value": f"{directory}/{TLS_KEY_KEY}"}]
    if backends.cassandra_tls.enabled and backends.cassandra_tls.server_hostname:
        env.append({"name": "CASQUE_CASSANDRA_TLS_SERVER_HOSTNAME", "value": backends.cassandra_tls.server_hostname})
    return env


def review(admission: Mapping[str, Any], settings: InjectionSettings, backends: Settings) -> dict[str, Any]:
    """The answer to one AdmissionReview: allowed, with the patch if the Pod gets a sidecar."""
    request = admission.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    pod = request.get("object") or {}
    if request.get("operation") == "CREATE" and pod.get("kind", "Pod") == "Pod":
        try:
            patch = plan(pod, settings, backends, request.get("namespace"))
        except InvalidInjection as error:
            response.update(allowed=False, status={"code": 422, "reason": "Invalid", "message": str(error)})
        else:
            if patch:
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode("ascii")
    return {
        "apiVersion": admission.get("apiVersion") or "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    }


def answer(admission: Mapping[str, Any], settings: InjectionSettings, backends: Settings) -> dict[str, Any]:
    """`review`, counted by outcome (casque_operator_admission_reviews_total) and logged when refused."""
    try:
        answered = review(admission, settings, backends)
    except Exception:
        # kopf's server answers 500; with failurePolicy Ignore the pod then starts without
        # its sidecar, and only this count tells.
        metrics.count_admission("error")
        log.exception("answering an admission review failed")
        raise
    result = outcome(answered)
    metrics.count_admission(result)
    if result == "refused":
        log.info("refused a pod: %s", answered["response"]["status"]["message"])
    return answered


def outcome(answer: Mapping[str, Any]) -> metrics.AdmissionOutcome:
    response = answer.get("response") or {}
    if not response.get("allowed", False):
        return "refused"
    return "injected" if response.get("patch") else "skipped"


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def _pointer(key: str) -> str:
    """`key` as one segment of a JSON Pointer (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _add(path: str, value: Any) -> dict[str, Any]:
    return {"op": "add", "path": path, "value": value}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": HEALTH_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }
