"""Sidecar injection as pure functions: a Pod in, a JSON Patch out (no kopf, no API server)."""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from casque.config import CassandraTlsSettings, Settings, ZooKeeperTlsSettings
from casque.operator import injection
from casque.operator.injection import InjectionSettings, InvalidInjection, plan, review
from casque.sidecar.config import DEFAULT_PORT, SidecarSettings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def apply_patch(document: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 `add`, the only operation the injector emits."""
    result = copy.deepcopy(document)
    for operation in patch:
        assert operation["op"] == "add", operation
        *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
        target: Any = result
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        value = copy.deepcopy(operation["value"])
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), value)
        else:
            assert last not in target, f"add would replace {operation['path']}"
            target[last] = value
    return result


def pod(annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "app", "annotations": annotations or {}},
        "spec": {"containers": [{"name": "app", "image": "example/app:1"}], **spec},
    }


def injected(document: dict[str, Any], settings: InjectionSettings | None = None) -> dict[str, Any]:
    return apply_patch(document, plan(document, settings or InjectionSettings(), Settings()))


def container(document: dict[str, Any], name: str) -> dict[str, Any]:
    spec = document["spec"]
    found = [c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name]
    assert len(found) == 1, found
    return found[0]


def env_of(spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in spec.get("env", [])}


ORDERS = {"casque.io/inject": "true", "casque.io/queue": "orders", "casque.io/subscriber": "billing"}


# --- who gets a sidecar ---------------------------------------------------------------------


@pytest.mark.parametrize("annotations", [None, {}, {"casque.io/inject": "false"}, {"casque.io/queue": "orders"}])
def test_pods_that_do_not_ask_are_untouched(annotations: dict[str, str] | None) -> None:
    document = pod(annotations)
    assert plan(document, InjectionSettings(), Settings()) == []
    answer = review(admission(document), InjectionSettings(), Settings())
    assert answer["response"] == {"uid": "42", "allowed": True}


def test_a_pod_without_metadata_or_spec_fields_is_untouched() -> None:
    assert plan({"spec": {"containers": []}}, InjectionSettings(), Settings()) == []


def test_an_annotated_pod_gets_a_native_sidecar_first_among_init_containers() -> None:
    init = {"name": "migrate", "image": "example/migrate:1"}
    result = injected(pod(ORDERS, initContainers=[init]))
    names = [c["name"] for c in result["spec"]["initContainers"]]
    assert names == [injection.SIDECAR_NAME, "migrate"]
    sidecar = container(result, injection.SIDECAR_NAME)
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["args"] == ["sidecar"]
    assert [c["name"] for c in result["spec"]["containers"]] == ["app"]


def test_the_sidecar_serves_the_annotated_queue_and_subscribers_on_localhost() -> None:
    annotations = {**ORDERS, "casque.io/subscriber": "billing, audit,billing", "casque.io/port": "9000"}
    result = injected(pod(annotations))
    env = env_of(container(result, injection.SIDECAR_NAME))
    assert env["CASQUE_SIDECAR_HOST"] == "127.0.0.1"
    assert env["CASQUE_SIDECAR_PORT"] == "9000"
    assert env["CASQUE_SIDECAR_QUEUE"] == "orders"
    assert env["CASQUE_SIDECAR_SUBSCRIBERS"] == "billing,audit"
    assert env["CASQUE_SIDECAR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    app = env_of(container(result, "app"))
    assert app == {
        "CASQUE_SIDECAR_URL": "http://127.0.0.1:9000",
        "CASQUE_SIDECAR_QUEUE": "orders",
        "CASQUE_SIDECAR_SUBSCRIBERS": "billing,audit",
    }


def test_the_kubelet_probes_the_sidecar_by_http_on_its_health_port() -> None:
    sidecar = container(injected(pod({**ORDERS, "casque.io/port": "9000"})), injection.SIDECAR_NAME)
    assert {"name": "casque-health", "containerPort": 9719, "protocol": "TCP"} in sidecar["ports"]
    assert env_of(sidecar)["CASQUE_SIDECAR_HEALTH_PORT"] == "9719"
    probes = {kind: sidecar[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert not any("exec" in probe for probe in probes.values())  # no process started per check
    assert {kind: probe["httpGet"] for kind, probe in probes.items()} == {
        "startupProbe": {"path": "/healthz", "port": "casque-health"},
        "livenessProbe": {"path": "/healthz", "port": "casque-health"},
        "readinessProbe": {"path": "/readyz?scope=serving", "port": "casque-health"},
    }


def test_the_health_port_moves_and_must_differ_from_the_metrics_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASQUE_INJECTION_HEALTH_PORT", "9800")  # the chart's sidecar.healthPort
    sidecar = container(injected(pod(ORDERS), InjectionSettings()), injection.SIDECAR_NAME)
    assert {"name": "casque-health", "containerPort": 9800, "protocol": "TCP"} in sidecar["ports"]
    assert env_of(sidecar)["CASQUE_SIDECAR_HEALTH_PORT"] == "9800"
    monkeypatch.setenv("CASQUE_INJECTION_HEALTH_PORT", "9718")
    with pytest.raises(ValueError, match="health and metrics ports are both 9718"):
        InjectionSettings()


@pytest.mark.parametrize(("port", "what"), [(9718, "metrics"), (9719, "health")])
def test_an_annotated_port_that_is_one_of_the_sidecars_own_is_refused(port: int, what: str) -> None:
    with pytest.raises(InvalidInjection, match=f"{port} is the sidecar's {what} port"):
        plan(pod({**ORDERS, "casque.io/port": str(port)}), InjectionSettings(), Settings())


def test_a_publish_only_sidecar_needs_no_queue() -> None:
    result = injected(pod({"casque.io/inject": "True"}))
    sidecar_env = env_of(container(result, injection.SIDECAR_NAME))
    assert "CASQUE_SIDECAR_QUEUE" not in sidecar_env and "CASQUE_SIDECAR_SUBSCRIBERS" not in sidecar_env
    assert env_of(container(result, "app")) == {"CASQUE_SIDECAR_URL": f"http://127.0.0.1:{DEFAULT_PORT}"}


def test_the_sidecar_uses_the_operators_backends_and_the_credentials_secret() -> None:
    backends = Settings(
        cassandra_contact_points=["c1", "c2"], cassandra_port=9142, cassandra_local_dc="dc2",
        keyspace="prod", consistency="QUORUM", zookeeper_hosts="zk1:2181,zk2:2181/x", zookeeper_root="/q",
    )
    settings = InjectionSettings(credentials_secret="cassandra-creds", username_key="user", password_key="pass")
    document = pod(ORDERS)
    env = env_of(container(apply_patch(document, plan(document, settings, backends)), injection.SIDECAR_NAME))
    assert env["CASQUE_CASSANDRA_CONTACT_POINTS"] == "c1,c2"
    assert env["CASQUE_CASSANDRA_PORT"] == "9142"
    assert env["CASQUE_CASSANDRA_LOCAL_DC"] == "dc2"
    assert env["CASQUE_KEYSPACE"] == "prod"
    assert env["CASQUE_CONSISTENCY"] == "QUORUM"
    assert env["CASQUE_ZOOKEEPER_HOSTS"] == "zk1:2181,zk2:2181/x"
    assert env["CASQUE_ZOOKEEPER_ROOT"] == "/q"
    assert env["CASQUE_CASSANDRA_USERNAME"] == {"secretKeyRef": {"name": "cassandra-creds", "key": "user"}}
    assert env["CASQUE_CASSANDRA_PASSWORD"] == {"secretKeyRef": {"name": "cassandra-creds", "key": "pass"}}


def tls_backends(**cassandra: Any) -> Settings:
    return Settings(
        cassandra_tls=CassandraTlsSettings(enabled=True, ca_file=Path("/etc/ops/ca.crt"), cert_file=Path("/etc/ops/tls.crt"),
                                           key_file=Path("/etc/ops/tls.key"), **cassandra),
        zookeeper_tls=ZooKeeperTlsSettings(enabled=True, verify_hostname=False),
    )


def test_with_tls_the_sidecar_mounts_the_namespaces_tls_secret_and_reads_its_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = InjectionSettings(cassandra_tls_secret="cassandra-tls", zookeeper_tls_secret="zookeeper-tls")
    backends = tls_backends(server_hostname="cassandra.db.svc")
    document = pod(ORDERS, volumes=[{"name": "data", "emptyDir": {}}])
    patched = apply_patch(document, plan(document, settings, backends))
    sidecar = container(patched, injection.SIDECAR_NAME)
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    assert volumes["casque-sidecar-cassandra-tls"]["secret"]["secretName"] == "cassandra-tls"
    assert volumes["casque-sidecar-zookeeper-tls"]["secret"]["secretName"] == "zookeeper-tls"
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert mounts["casque-sidecar-cassandra-tls"] == "/etc/casque/tls/cassandra"
    assert mounts["casque-sidecar-zookeeper-tls"] == "/etc/casque/tls/zookeeper"
    # The app's containers get neither the volume nor the settings.
    assert "volumeMounts" not in container(patched, "app")
    assert not any("TLS" in name for name in env_of(container(patched, "app")))
    # What the sidecar reads back: the operator's TLS settings, with the files of its mount.
    for name, value in env_of(sidecar).items():
        if name.startswith("CASQUE_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    read = Settings()
    assert read.cassandra_tls == CassandraTlsSettings(
        enabled=True, ca_file=Path("/etc/casque/tls/cassandra/ca.crt"),
        cert_file=Path("/etc/casque/tls/cassandra/tls.crt"), key_file=Path("/etc/casque/tls/cassandra/tls.key"),
        server_hostname="cassandra.db.svc")
    # No files in the operator's ZooKeeper settings: the system's CAs, no hostname check, as its.
    assert read.zookeeper_tls == ZooKeeperTlsSettings(enabled=True, verify_hostname=False)


def test_tls_files_without_a_secret_for_sidecars_refuse_the_pod() -> None:
    document = pod(ORDERS)
    with pytest.raises(InvalidInjection, match="CASQUE_INJECTION_CASSANDRA_TLS_SECRET"):
        plan(document, InjectionSettings(), tls_backends())
    # Without TLS no Secret is mounted, even when one is named.
    plain = apply_patch(document, plan(document, InjectionSettings(cassandra_tls_secret="cassandra-tls"), Settings()))
    assert [v["name"] for v in plain["spec"]["volumes"]] == [injection.TMP_VOLUME]
    assert not any("TLS" in name for name in env_of(container(plain, injection.SIDECAR_NAME)))


def test_with_zookeeper_authentication_the_sidecar_gets_its_namespaces_identity_only() -> None:
    installation_password = "i" * 40
    derivation_key = "k" * 40
    backends = Settings(zookeeper_username="casque", zookeeper_password=installation_password,  # type: ignore[arg-type]
                        derivation_key=derivation_key)
    document = pod(ORDERS)
    patched = apply_patch(document, plan(document, InjectionSettings(), backends))
    env = env_of(container(patched, injection.SIDECAR_NAME))
    for variable, key in (("USERNAME", "username"), ("PASSWORD", "password"), ("ACL", "acl")):
        assert env[f"CASQUE_ZOOKEEPER_{variable}"] == {"secretKeyRef": {"name": "casque-zookeeper", "key": key}}
    assert installation_password not in json.dumps(patched) and derivation_key not in json.dumps(patched)
    assert "CASQUE_DERIVATION_KEY" not in env
    assert not any(name.startswith("CASQUE_ZOOKEEPER_") and name != "CASQUE_ZOOKEEPER_HOSTS"
                   for name in env_of(container(injected(pod(ORDERS)), injection.SIDECAR_NAME))
                   if name != "CASQUE_ZOOKEEPER_ROOT")


def test_a_token_secret_reaches_the_sidecar_and_the_app() -> None:
    result = injected(pod({**ORDERS, "casque.io/token-secret": "orders-api"}))
    expected = {"secretKeyRef": {"name": "orders-api", "key": "token"}}
    assert env_of(container(result, injection.SIDECAR_NAME))["CASQUE_SIDECAR_TOKEN"] == expected
    assert env_of(container(result, "app"))["CASQUE_SIDECAR_TOKEN"] == expected


def test_a_push_token_secret_reaches_the_sidecar_only(monkeypatch: pytest.MonkeyPatch) -> None:
    result = injected(pod({**ORDERS, "casque.io/push-token-secret": "orders-push"}))
    sidecar = env_of(container(result, injection.SIDECAR_NAME))
    assert sidecar["CASQUE_SIDECAR_PUSH_TOKEN"] == {"secretKeyRef": {"name": "orders-push", "key": "push-token"}}
    # The app checks pushes with the Secret named in its own spec; the webhook adds nothing there.
    assert "CASQUE_SIDECAR_PUSH_TOKEN" not in env_of(container(result, "app"))
    # What the kubelet will set from the Secret is what the sidecar sends in Casque-Push-Token.
    monkeypatch.setenv("CASQUE_SIDECAR_PUSH_TOKEN", "s" * 32)
    token = SidecarSettings().push_token
    assert token is not None and token.get_secret_value() == "s" * 32
    assert "CASQUE_SIDECAR_PUSH_TOKEN" not in env_of(container(injected(pod(ORDERS)), injection.SIDECAR_NAME))


def test_one_secret_may_hold_the_api_token_and_the_push_token() -> None:
    annotations = {**ORDERS, "casque.io/token-secret": "orders", "casque.io/push-token-secret": "orders"}
    sidecar = env_of(container(injected(pod(annotations)), injection.SIDECAR_NAME))
    assert sidecar["CASQUE_SIDECAR_TOKEN"] == {"secretKeyRef": {"name": "orders", "key": "token"}}
    assert sidecar["CASQUE_SIDECAR_PUSH_TOKEN"] == {"secretKeyRef": {"name": "orders", "key": "push-token"}}


def test_the_sidecar_is_locked_down_and_writes_only_to_its_tmp_volume() -> None:
    result = injected(pod(ORDERS))
    sidecar = container(result, injection.SIDECAR_NAME)
    assert sidecar["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": injection.SIDECAR_UID,
        "runAsGroup": injection.SIDECAR_UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert sidecar["volumeMounts"] == [{"name": injection.TMP_VOLUME, "mountPath": "/tmp"}]
    assert {"name": injection.TMP_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}} in result["spec"]["volumes"]
    assert sidecar["resources"] == {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}


def test_an_ordinary_container_when_native_sidecars_are_off() -> None:
    result = injected(pod(ORDERS, volumes=[{"name": "data", "emptyDir": {}}]), InjectionSettings(native_sidecar=False))
    assert "initContainers" not in result["spec"]
    assert [c["name"] for c in result["spec"]["containers"]] == ["app", injection.SIDECAR_NAME]
    assert "restartPolicy" not in container(result, injection.SIDECAR_NAME)
    assert [v["name"] for v in result["spec"]["volumes"]] == ["data", injection.TMP_VOLUME]


def test_app_settings_already_present_are_kept() -> None:
    app = {"name": "app", "image": "a", "env": [{"name": "CASQUE_SIDECAR_QUEUE", "value": "mine"}, {"name": "X", "value": "1"}]}
    other = {"name": "helper", "image": "b", "env": [{"name": "CASQUE_SIDECAR_URL", "value": "http://elsewhere"}]}
    result = injected(pod(ORDERS, containers=[app, other]))
    assert env_of(container(result, "app")) == {
        "CASQUE_SIDECAR_QUEUE": "mine", "X": "1",
        "CASQUE_SIDECAR_URL": "http://127.0.0.1:8717", "CASQUE_SIDECAR_SUBSCRIBERS": "billing",
    }
    assert env_of(container(result, "helper"))["CASQUE_SIDECAR_URL"] == "http://elsewhere"


def test_an_injected_pod_carries_the_label_the_backends_admit() -> None:
    bare = injected(pod({"casque.io/inject": "true", "casque.io/queue": "orders"}))
    assert bare["metadata"]["labels"] == {injection.SIDECAR_LABEL: injection.SIDECAR_LABEL_VALUE}
    labelled = pod({"casque.io/inject": "true", "casque.io/queue": "orders"})
    labelled["metadata"]["labels"] = {"app": "billing"}
    assert injected(labelled)["metadata"]["labels"] == {
        "app": "billing", injection.SIDECAR_LABEL: injection.SIDECAR_LABEL_VALUE
    }


def test_the_sidecar_serves_metrics_on_a_named_port_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    document = pod({"casque.io/inject": "true", "casque.io/queue": "orders"})
    sidecar = container(injected(document), injection.SIDECAR_NAME)
    assert {"name": "casque-metrics", "containerPort": 9718, "protocol": "TCP"} in sidecar["ports"]
    assert env_of(sidecar)["CASQUE_SIDECAR_METRICS_PORT"] == "9718"
    monkeypatch.setenv("CASQUE_INJECTION_METRICS_PORT", "")  # the chart's sidecar.metricsPort: null
    sidecar = container(injected(document, InjectionSettings()), injection.SIDECAR_NAME)
    assert [p["name"] for p in sidecar["ports"]] == ["casque-health"]
    assert "CASQUE_SIDECAR_METRICS_PORT" not in env_of(sidecar)


def test_an_app_port_that_is_the_metrics_port_is_refused() -> None:
    document = pod({"casque.io/inject": "true", "casque.io/queue": "orders"},
                   containers=[{"name": "web", "image": "example/app:1", "ports": [{"containerPort": 9718}]}])
    with pytest.raises(InvalidInjection, match="9718, the sidecar's metrics port"):
        plan(document, InjectionSettings(), Settings())


def test_an_app_port_that_is_the_health_port_is_refused() -> None:
    document = pod({"casque.io/inject": "true", "casque.io/queue": "orders"},
                   containers=[{"name": "web", "image": "example/app:1", "ports": [{"containerPort": 9719}]}])
    with pytest.raises(InvalidInjection, match="9719, the sidecar's health port"):
        plan(document, InjectionSettings(), Settings())


def test_a_pod_is_never_injected_twice() -> None:
    once = injected(pod(ORDERS))
    assert plan(once, InjectionSettings(), Settings()) == []
    ordinary = injected(pod(ORDERS), InjectionSettings(native_sidecar=False))
    assert plan(ordinary, InjectionSettings(), Settings()) == []


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({"casque.io/queue": "Orders"}, "casque.io/queue: 'Orders' is not a queue or subscriber name"),
        ({"casque.io/queue": "orders", "casque.io/subscriber": "a,b_c"}, "'b_c' is not a queue or subscriber name"),
        ({"casque.io/subscriber": "billing"}, "casque.io/subscriber needs casque.io/queue"),
        ({"casque.io/port": "0"}, "casque.io/port: '0' is not a port number"),
        ({"casque.io/port": "http"}, "casque.io/port: 'http' is not a port number"),
        ({"casque.io/port": "70000"}, "casque.io/port: '70000' is not a port number"),
        ({"casque.io/token-secret": "Bad Name"}, "casque.io/token-secret: 'Bad Name' is not a Secret name"),
        ({"casque.io/push-token-secret": "push_token"},
         "casque.io/push-token-secret: 'push_token' is not a Secret name"),
    ],
)
def test_impossible_annotations_refuse_the_pod_with_a_reason(annotations: dict[str, str], message: str) -> None:
    document = pod({"casque.io/inject": "true", **annotations})
    with pytest.raises(InvalidInjection, match=re.escape(message)):
        plan(document, InjectionSettings(), Settings())
    answer = review(admission(document), InjectionSettings(), Settings())["response"]
    assert answer["allowed"] is False
    assert answer["status"]["code"] == 422 and message in answer["status"]["message"]
    assert "patch" not in answer
    assert injection.outcome({"response": answer}) == "refused"


def test_a_port_taken_by_the_app_is_refused() -> None:
    app = {"name": "web", "image": "a", "ports": [{"containerPort": 8717}]}
    with pytest.raises(InvalidInjection, match="container 'web' uses port 8717"):
        plan(pod(ORDERS, containers=[app]), InjectionSettings(), Settings())
    assert plan(pod({**ORDERS, "casque.io/port": "8718"}, containers=[app]), InjectionSettings(), Settings())


def test_a_volume_named_like_the_sidecars_is_refused() -> None:
    with pytest.raises(InvalidInjection, match="casque-sidecar-tmp"):
        plan(pod(ORDERS, volumes=[{"name": injection.TMP_VOLUME, "emptyDir": {}}]), InjectionSettings(), Settings())


# --- the AdmissionReview --------------------------------------------------------------------


def test_with_keyspace_isolation_the_sidecar_gets_its_namespaces_keyspace_and_role_only() -> None:
    installation_password = "c" * 40
    backends = Settings(cassandra_isolation="keyspace", cassandra_username="casque", keyspace="casque",
                        cassandra_password=installation_password, derivation_key="k" * 40)  # type: ignore[arg-type]
    shared = InjectionSettings(credentials_secret="cassandra-shared")
    answer = review(admission(pod(ORDERS)), shared, backends)["response"]
    patched = apply_patch(pod(ORDERS), json.loads(base64.b64decode(answer["patch"])))
    env = env_of(container(patched, injection.SIDECAR_NAME))
    assert env["CASQUE_KEYSPACE"] == "casque_shop"  # the AdmissionReview's namespace
    for variable, key in (("USERNAME", "username"), ("PASSWORD", "password")):
        assert env[f"CASQUE_CASSANDRA_{variable}"] == {"secretKeyRef": {"name": "casque-cassandra-role", "key": key}}
    # Neither the installation's password nor the shared Secret, nor the setting itself:
    # the sidecar knows one keyspace.
    assert installation_password not in json.dumps(patched) and "cassandra-shared" not in json.dumps(patched)
    assert "k" * 40 not in json.dumps(patched)
    assert "CASQUE_CASSANDRA_ISOLATION" not in env
    # Without isolation, the installation's keyspace and the shared Secret, as before.
    plain = env_of(container(injected(pod(ORDERS), shared), injection.SIDECAR_NAME))
    assert plain["CASQUE_KEYSPACE"] == "casque"
    assert plain["CASQUE_CASSANDRA_USERNAME"] == {"secretKeyRef": {"name": "cassandra-shared", "key": "username"}}


def test_with_keyspace_isolation_a_pod_of_no_known_namespace_is_refused() -> None:
    backends = Settings(cassandra_isolation="keyspace", cassandra_username="casque",
                        cassandra_password="c" * 40, derivation_key="k" * 40)  # type: ignore[arg-type]
    with pytest.raises(InvalidInjection, match="namespace is unknown"):
        plan(pod(ORDERS), InjectionSettings(), backends)


def admission(document: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "42", "operation": operation, "namespace": "shop", "object": document},
    }


def test_the_review_carries_the_patch_as_base64_json_patch() -> None:
    document = pod(ORDERS)
    answer = review(admission(document), InjectionSettings(), Settings())
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "42" and response["allowed"] is True and response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    assert patch == plan(document, InjectionSettings(), Settings())
    assert injection.outcome(answer) == "injected"


def test_only_creations_are_patched() -> None:
    answer = review(admission(pod(ORDERS), operation="UPDATE"), InjectionSettings(), Settings())
    assert answer["response"] == {"uid": "42", "allowed": True}
    assert injection.outcome(answer) == "skipped"


# --- settings and names stay in step with the sidecar and the client ------------------------


def test_every_variable_given_to_the_sidecar_is_one_it_reads() -> None:
    settings = InjectionSettings(credentials_secret="creds")
    backends = Settings(cassandra_local_dc="dc1")
    request = injection.parse_request({**ORDERS, "casque.io/token-secret": "t", "casque.io/push-token-secret": "p",
                                       "casque.io/publish-scope": "orders", "casque.io/subscribe-scope": "orders/*"})
    names = {env["name"] for env in injection.sidecar_container(request, settings, backends)["env"]}
    known = {f"CASQUE_SIDECAR_{field.upper()}" for field in SidecarSettings.model_fields}
    known |= {f"CASQUE_{field.upper()}" for field in Settings.model_fields}
    assert names <= known, names - known


def test_every_variable_given_to_the_app_is_one_the_client_reads() -> None:
    client_source = (ROOT / "client" / "casque_client" / "client.py").read_text()
    request = injection.parse_request({**ORDERS, "casque.io/token-secret": "t"})
    for env in injection.app_env(request):
        assert f'"{env["name"]}"' in client_source, env["name"]


def test_injection_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASQUE_INJECTION_IMAGE", "registry.example/casque/sidecar@sha256:" + "a" * 64)
    monkeypatch.setenv("CASQUE_INJECTION_NATIVE_SIDECAR", "false")
    monkeypatch.setenv("CASQUE_INJECTION_CPU_LIMIT", "")
    monkeypatch.setenv("CASQUE_INJECTION_MEMORY_LIMIT", "")
    monkeypatch.setenv("CASQUE_INJECTION_CREDENTIALS_SECRET", "")
    settings = InjectionSettings()
    assert settings.image.endswith("a" * 64) and settings.native_sidecar is False
    assert settings.cpu_limit is None and settings.memory_limit is None and settings.credentials_secret is None
    sidecar = injection.sidecar_container(injection.parse_request({}), settings, Settings())
    assert "limits" not in sidecar["resources"]
    monkeypatch.setenv("CASQUE_INJECTION_MEMORY_REQUEST", "lots")
    with pytest.raises(ValueError, match="memory_request"):
        InjectionSettings()


def test_the_default_image_is_this_version() -> None:
    from importlib.metadata import version

    assert InjectionSettings().image == f"casque/sidecar:{version('casque')}"


# --- the examples ---------------------------------------------------------------------------


def test_the_manual_example_is_what_the_webhook_injects() -> None:
    """examples/app-manual-sidecar.yaml is app-deployment.yaml after injection, written by hand."""
    automatic = yaml.safe_load((EXAMPLES / "app-deployment.yaml").read_text())
    manual = yaml.safe_load((EXAMPLES / "app-manual-sidecar.yaml").read_text())
    template = automatic["spec"]["template"]
    document = {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], "spec": template["spec"]}
    settings = InjectionSettings(image="casque/sidecar:0.1.0", credentials_secret="casque-cassandra")
    backends = Settings(
        cassandra_contact_points=["cassandra.cassandra.svc"], zookeeper_hosts="zookeeper.zookeeper.svc:2181"
    )
    result = apply_patch(document, plan(document, settings, backends))
    assert result["spec"] == manual["spec"]["template"]["spec"]
    assert result["metadata"]["labels"] == manual["spec"]["template"]["metadata"]["labels"]
    assert "annotations" not in manual["spec"]["template"]["metadata"]
    assert {k: v for k, v in automatic.items() if k != "spec"} == {k: v for k, v in manual.items() if k != "spec"}


def test_the_manual_form_in_the_deploy_guide_is_what_the_webhook_injects() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("## The sidecar by hand") :]
    block = section[section.index("```yaml\n") + len("```yaml\n") : section.index("```\n", section.index("```yaml"))]
    documented = yaml.safe_load(block)
    settings = InjectionSettings(image="registry.example.com/casque/sidecar:0.1.0", credentials_secret="casque-cassandra")
    backends = Settings(
        cassandra_contact_points=["cassandra.cassandra.svc"], zookeeper_hosts="zookeeper.zookeeper.svc:2181"
    )
    request = injection.parse_request({"casque.io/queue": "orders", "casque.io/subscriber": "billing"})
    assert documented["initContainers"] == [injection.sidecar_container(request, settings, backends)]
    assert documented["volumes"] == [{"name": injection.TMP_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}}]


# --- scopes ---------------------------------------------------------------------------------


def test_scope_annotations_reach_the_sidecar_only() -> None:
    annotations = {**ORDERS, "casque.io/publish-scope": "orders, audit,orders",
                   "casque.io/subscribe-scope": "orders/billing,audit/*"}
    result = injected(pod(annotations))
    env = env_of(container(result, injection.SIDECAR_NAME))
    assert env["CASQUE_SIDECAR_PUBLISH_SCOPE"] == "orders,audit"
    assert env["CASQUE_SIDECAR_SUBSCRIBE_SCOPE"] == "orders/billing,audit/*"
    settings = SidecarSettings(publish_scope=env["CASQUE_SIDECAR_PUBLISH_SCOPE"],
                               subscribe_scope=env["CASQUE_SIDECAR_SUBSCRIBE_SCOPE"])
    assert settings.publish_scope == ["orders", "audit"] and settings.subscribe_scope == ["orders/billing", "audit/*"]
    app_env = env_of(container(result, "app"))
    assert "CASQUE_SIDECAR_PUBLISH_SCOPE" not in app_env and "CASQUE_SIDECAR_SUBSCRIBE_SCOPE" not in app_env


def test_absent_scopes_restrict_nothing_and_empty_ones_allow_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    absent = env_of(container(injected(pod(ORDERS)), injection.SIDECAR_NAME))
    assert "CASQUE_SIDECAR_PUBLISH_SCOPE" not in absent and "CASQUE_SIDECAR_SUBSCRIBE_SCOPE" not in absent
    empty = env_of(container(injected(pod({**ORDERS, "casque.io/publish-scope": ""})), injection.SIDECAR_NAME))
    assert empty["CASQUE_SIDECAR_PUBLISH_SCOPE"] == ""
    monkeypatch.setenv("CASQUE_SIDECAR_PUBLISH_SCOPE", "")
    settings = SidecarSettings()
    assert settings.publish_scope == [] and settings.subscribe_scope is None


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({"casque.io/publish-scope": "Orders"}, "casque.io/publish-scope: 'Orders' is not a queue name"),
        ({"casque.io/subscribe-scope": "billing"}, "casque.io/subscribe-scope: 'billing' is not queue/subscriber"),
        ({"casque.io/subscribe-scope": "orders/b_c"}, "'orders/b_c' is not queue/subscriber or queue/*"),
    ],
)
def test_malformed_scopes_refuse_the_pod(annotations: dict[str, str], message: str) -> None:
    answer = review(admission(pod({"casque.io/inject": "true", **annotations})), InjectionSettings(), Settings())
    response = answer["response"]
    assert response["allowed"] is False and message in response["status"]["message"]


@pytest.mark.parametrize(
    ("scope", "outside"),
    [
        ("orders/audit", "orders/billing"),  # another subscriber of the queue
        ("audit/billing,audit/*", "orders/billing, orders/audit"),  # the same names on another queue
        ("", "orders/billing, orders/audit"),  # an empty scope allows nothing
    ],
)
def test_subscribers_outside_the_subscribe_scope_refuse_the_pod(scope: str, outside: str) -> None:
    annotations = {**ORDERS, "casque.io/subscriber": "billing,audit", "casque.io/subscribe-scope": scope}
    answer = review(admission(pod(annotations)), InjectionSettings(), Settings())["response"]
    assert answer["allowed"] is False and "patch" not in answer
    message = answer["status"]["message"]
    assert f"casque.io/subscriber: the sidecar would consume for {outside}, outside the pod's " in message
    assert f"casque.io/subscribe-scope ({scope.replace(',', ', ') or 'empty: nothing'})" in message


@pytest.mark.parametrize("scope", ["orders/billing,orders/audit", "orders/*", "orders/*,orders/billing,audit/x"])
def test_subscribers_inside_the_subscribe_scope_are_served(scope: str) -> None:
    annotations = {**ORDERS, "casque.io/subscriber": "billing,audit", "casque.io/subscribe-scope": scope}
    env = env_of(container(injected(pod(annotations)), injection.SIDECAR_NAME))
    assert env["CASQUE_SIDECAR_SUBSCRIBERS"] == "billing,audit" and env["CASQUE_SIDECAR_SUBSCRIBE_SCOPE"] == scope
    # A publish-only sidecar serves no subscriber, so any subscribe scope fits it.
    assert plan(pod({"casque.io/inject": "true", "casque.io/subscribe-scope": ""}), InjectionSettings(), Settings())


def test_a_host_network_pod_is_refused_without_a_token() -> None:
    document = pod(ORDERS, hostNetwork=True)
    answer = review(admission(document), InjectionSettings(), Settings())["response"]
    assert answer["allowed"] is False and "hostNetwork" in answer["status"]["message"]
    assert "casque.io/token-secret" in answer["status"]["message"]
    with_token = injected(pod({**ORDERS, "casque.io/token-secret": "orders-api"}, hostNetwork=True))
    assert env_of(container(with_token, injection.SIDECAR_NAME))["CASQUE_SIDECAR_TOKEN"]
    assert plan(pod(ORDERS, hostNetwork=False), InjectionSettings(), Settings())
