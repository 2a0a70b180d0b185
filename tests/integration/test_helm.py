"""The Helm chart, the examples and the injection webhook against the test kube-apiserver.

The chart is linted, rendered with default and non-default values and applied with
`kubectl apply --dry-run=server`, so the API server validates every object (the CRDs are
installed for real first, so that the examples' Queues and Subscribers are checked against
them). Values that break values.schema.json must fail. The RBAC is applied for real and
asked what it allows. The injection webhook runs as `casque operator run` does it, on
127.0.0.1, and the API server calls it when Pods are created. No kubelet runs, so Pods are
only stored. Waits poll a condition with a bounded timeout; nothing is timed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from casque.config import CassandraTlsSettings, ReplicationSettings, Settings, ZooKeeperTlsSettings
from casque.devstack.kube import KubeCluster
from casque.operator import injection, metrics as operator_metrics
from casque.operator.context import OperatorOptions
from casque.operator.quotas import QuotaSettings
from casque.sidecar.metrics import SidecarMetrics
from tests.fixtures.kube import kube_tool
from tests.fixtures.waiting import reserved_port, wait_for
from tests.unit.test_dockerfiles import cli_call

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "casque"
EXAMPLES = ROOT / "examples"
CRD_FILES = sorted((ROOT / "crds").glob("*.yaml"))
SCHEMA_ERROR = "values don't meet the specifications of the schema"






# --- tools ------------------------------------------------------------------------------------


class Tools:
    """helm and kubectl pointed at the session's API server."""

    def __init__(self, cluster: KubeCluster, home: Path) -> None:
        self.helm = str(kube_tool("helm"))
        self.kubectl = cluster.kubectl_args()
        self.env = {
            **os.environ,
            "KUBECONFIG": str(cluster.kubeconfig_path),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        version = json.loads(self.run(*self.kubectl, "version", "-o", "json").stdout)
        self.kube_version = version["serverVersion"]["gitVersion"]
        self.values_dir = home / "values"
        self.values_dir.mkdir()

    def run(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            list(args), input=input, capture_output=True, text=True, env=self.env, timeout=120, check=False
        )
        if check and result.returncode != 0:
            pytest.fail(f"{' '.join(args[:4])} ... exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def values_file(self, values: dict[str, Any]) -> str:
        path = self.values_dir / f"{uuid.uuid4().hex}.yaml"
        path.write_text(yaml.safe_dump(values))
        return str(path)

    def template(
        self, namespace: str, values: dict[str, Any] | None = None, *extra: str, release: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        args = [self.helm, "template", release or f"r{uuid.uuid4().hex[:6]}", str(CHART), "--namespace", namespace,
                "--kube-version", self.kube_version, *extra]  # fmt: skip
        if values:
            args += ["--values", self.values_file(values)]
        return self.run(*args, check=check)

    def render(self, namespace: str, values: dict[str, Any] | None = None, *extra: str, release: str | None = None) -> list[dict[str, Any]]:
        text = self.template(namespace, values, *extra, release=release).stdout
        return [doc for doc in yaml.safe_load_all(text) if doc]

    def dry_run(self, manifest: str) -> str:
        # Without -n: every namespaced object of the chart names its namespace.
        return self.run(*self.kubectl, "apply", "--dry-run=server", "-f", "-", input=manifest).stdout

    def can_i(self, namespace: str, service_account: str, verb: str, resource: str, on: str | None = None) -> bool:
        result = self.run(
            *self.kubectl, "auth", "can-i", verb, resource, "-n", on or namespace,
            f"--as=system:serviceaccount:{namespace}:{service_account}", check=False,
        )  # fmt: skip
        assert result.stdout.strip() in ("yes", "no"), result.stdout + result.stderr
        return result.stdout.strip() == "yes"


@pytest.fixture(scope="module")
def tools(kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Tools:  # noqa: F811
    return Tools(kube_cluster, tmp_path_factory.mktemp("helm"))


def established(api: client.ApiextensionsV1Api, name: str) -> bool:
    conditions = api.read_custom_resource_definition(name).status.conditions or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)


@pytest.fixture(scope="module")
def casque_crds(tools: Tools, kube_client: client.ApiClient) -> None:  # noqa: F811
    """crds/ applied for real (other modules may have created them already)."""
    tools.run(*tools.kubectl, "apply", *(a for path in CRD_FILES for a in ("-f", str(path))))
    api = client.ApiextensionsV1Api(kube_client)
    for name in ("queues.casque.io", "subscribers.casque.io"):
        wait_for(f"CRD {name} to be Established", lambda name=name: established(api, name))


def stand_in_crds(api: client.ApiextensionsV1Api, group: str, kinds: list[str]) -> Iterator[None]:
    """Stand-ins for another project's CRDs (the kinds only, any content), so that the API
    server accepts the chart's optional objects of those kinds."""
    created: list[str] = []
    for kind in kinds:
        plural = f"{kind.lower()}s"
        name = f"{plural}.{group}"
        body = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": name},
            "spec": {
                "group": group,
                "scope": "Namespaced",
                "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                "versions": [{
                    "name": "v1", "served": True, "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }],
            },
        }  # fmt: skip
        try:
            api.create_custom_resource_definition(body)
            created.append(name)
        except ApiException as error:
            if error.status != 409:
                raise
        wait_for(f"CRD {name} to be Established", lambda: established(api, name))
    yield
    for name in created:
        api.delete_custom_resource_definition(name)


@pytest.fixture(scope="module")
def service_monitor_crd(kube_client: client.ApiClient) -> Iterator[None]:  # noqa: F811
    """The Prometheus Operator's ServiceMonitor and PodMonitor, for the chart's toggles."""
    yield from stand_in_crds(client.ApiextensionsV1Api(kube_client), "monitoring.coreos.com",
                             ["ServiceMonitor", "PodMonitor"])


@pytest.fixture(scope="module")
def cert_manager_crds(kube_client: client.ApiClient) -> Iterator[None]:  # noqa: F811
    """cert-manager's Issuer and Certificate, for the webhook's certManager mode."""
    yield from stand_in_crds(client.ApiextensionsV1Api(kube_client), "cert-manager.io", ["Issuer", "Certificate"])


@pytest.fixture
def other_namespace(kube_client: client.ApiClient) -> Iterator[str]:  # noqa: F811
    core = client.CoreV1Api(kube_client)
    name = f"test-{uuid.uuid4().hex[:12]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def of_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in documents if d["kind"] == kind]


def one(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = of_kind(documents, kind)
    return found


def operator_container(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(documents, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


# --- lint and schema --------------------------------------------------------------------------


# Backends of your own instead of the release's (backends.embedded, on by default).
OWN_BACKENDS: dict[str, Any] = {"backends": {"embedded": False}}
# What GitOps renders with (`helm template`, no lookup): every secret from a Secret of the user's.
GITOPS_SECRETS: dict[str, Any] = {"cassandra": {"auth": {"existingSecret": "cassandra-login"}},
                                  "zookeeper": {"auth": {"existingSecret": "zookeeper-login"}},
                                  "derivationKey": {"existingSecret": "derivation-key"}}

NON_DEFAULT: dict[str, Any] = {
    **OWN_BACKENDS,
    "image": {"registry": "registry.example.com/platform", "pullPolicy": "Always", "pullSecrets": [{"name": "regcred"}]},
    "cassandra": {
        "contactPoints": ["cassandra-0.cassandra", "cassandra-1.cassandra"],
        "port": 9142,
        "localDatacenter": "dc1",
        "keyspace": "shop_queues",
        "consistency": "QUORUM",
        "replication": {"strategy": "SimpleStrategy", "factor": 1},
        "auth": {"username": "casque", "password": "s3cret-of-16-chars"},
        "tls": {"enabled": True, "secret": "cassandra-tls", "clientCertificate": True,
                "serverHostname": "cassandra.shop.svc"},
    },
    "zookeeper": {"connect": "zk-0.zk:2181,zk-1.zk:2181", "root": "/shop/casque",
                  "auth": {"username": "casque", "password": "z" * 32},
                  "tls": {"enabled": True, "secret": "zookeeper-tls"}},
    "quotas": {"maxQueues": 20, "maxShardPriorities": 64, "maxRetention": "14d", "maxWritesPerSecond": 500},
    "operator": {
        "image": {"digest": "sha256:" + "ab" * 32},
        "replicas": 3,
        "leaderElection": {"leaseName": "shop-operator", "leaseDurationSeconds": 20},
        "refreshIntervalSeconds": 10,
        "verbose": True,
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}},
        "podDisruptionBudget": {"maxUnavailable": "50%"},
        "podAnnotations": {"example.com/team": "platform"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "priorityClassName": "system-cluster-critical",
    },
    "sidecar": {
        "image": {"tag": "0.1.0-rc1"},
        "nativeSidecar": False,
        "credentialsSecret": "casque-cassandra",
        "metricsPort": 9800,
        "resources": {"requests": {"cpu": "100m", "memory": "96Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
    },
    "injection": {
        "failurePolicy": "Fail",
        "timeoutSeconds": 3,
        "namespaceSelector": {"matchLabels": {"casque.io/injection": "enabled"}},
        "objectSelector": {"matchExpressions": [{"key": "casque.io/skip", "operator": "DoesNotExist"}]},
    },
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                "podMonitor": {"enabled": True, "interval": "15s"}},
    "networkPolicy": {
        "enabled": True,
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "apiServer": {"to": [{"ipBlock": {"cidr": "10.96.0.1/32"}}]},
        "backends": {"enabled": True, "additionalFrom": [{"podSelector": {"matchLabels": {"spark-role": "executor"}}}]},
    },
}

MINIMAL: dict[str, Any] = {
    **OWN_BACKENDS,
    "operator": {"replicas": 1, "leaderElection": {"enabled": False}, "podDisruptionBudget": {"enabled": False}},
    "cassandra": {"auth": {"existingSecret": "cassandra-credentials", "usernameKey": "user", "passwordKey": "pass"}},
    "serviceAccount": {"create": False, "name": "casque-operator"},
    "rbac": {"create": False},
    "injection": {"enabled": False},
    "metrics": {"enabled": False},
}


EMBEDDED: dict[str, Any] = {"backends": {"embedded": True, "zookeeper": {"replicas": 3}, "cassandra": {"replicas": 3}}}


@pytest.mark.parametrize("values", [None, NON_DEFAULT, MINIMAL, EMBEDDED], ids=["default", "non-default", "minimal",
                                                                                "embedded"])
def test_helm_lint(tools: Tools, values: dict[str, Any] | None) -> None:
    extra = ["--values", tools.values_file(values)] if values else []
    result = tools.run(tools.helm, "lint", "--strict", str(CHART), "--kube-version", tools.kube_version, *extra)
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"operator": {"replicas": 0}}, "replicas"),
        ({"operator": {"leaderElection": {"enabled": False}}}, "replicas"),  # 2 replicas would both act
        ({"operator": {"replica": 2}}, "replica"),  # a misspelt key
        ({"operator": {"watchNamespaces": ["Shop"]}}, "watchNamespaces"),
        ({"cassandra": {"consistency": "TWO"}}, "consistency"),
        ({"cassandra": {"keyspace": "Shop-Queues"}}, "keyspace"),
        ({"cassandra": {"isolation": "row"}}, "isolation"),
        ({"cassandra": {"replication": {"datacenters": None}}}, "datacenters"),
        ({"cassandra": {"auth": {"username": "casque"}}}, "password"),
        ({"cassandra": {"auth": {"username": "casque", "password": "cassandra"}}}, "password"),  # too short to resist guessing
        ({"zookeeper": {"auth": {"username": "casque", "password": "z" * 31}}}, "password"),
        ({"derivationKey": {"existingSecret": "Not A Name"}}, "existingSecret"),
        ({"derivationKey": {"previousSecret": "Not A Name"}}, "previousSecret"),
        ({"cassandra": {"derivationKey": {"existingSecret": "mine"}}}, "derivationKey"),  # its old place
        ({"zookeeper": {"connect": "zookeeper"}}, "connect"),
        ({"cassandra": {"tls": {"enabled": True, "clientCertificate": True}}}, "secret"),  # whose certificate?
        ({"zookeeper": {"tls": {"enabled": True, "verifyHostnames": False}}}, "verifyHostnames"),
        ({"zookeeper": {"root": "casque"}}, "root"),
        ({"injection": {"failurePolicy": "Maybe"}}, "failurePolicy"),
        ({"injection": {"tls": {"mode": "secret"}}}, "existingSecret"),
        ({"sidecar": {"resources": {"requests": {"memory": "lots"}}}}, "memory"),
        ({"operator": {"ports": {"webhook": 70000}}}, "webhook"),
        ({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}}, "enabled"),
        ({"networkPolicy": {"apiServer": {"ports": []}}}, "ports"),
        ({"sidecar": {"metricsPort": 0}}, "metricsPort"),
        ({"networkPolicy": {"backends": {"cassandra": {"podSelector": None}}}}, "podSelector"),
        ({"networkPolicy": {"backends": {"clients": {"namespaces": ["Shop"]}}}}, "namespaces"),
        ({"networkPolicy": {"backends": {"clients": {"namespaceSelector": []}}}}, "namespaceSelector"),
        ({"networkPolicy": {"enabled": "auto"}}, "enabled"),
        ({"backends": {"zookeeper": {"replicas": 2}}}, "replicas"),  # no quorum survives a loss
        ({"backends": {"cassandra": {"replicas": 2}}}, "replicas"),
        ({"backends": {"embedded": "yes"}}, "embedded"),
        ({"backends": {"cassandra": {"storage": {"storageClassName": 5}}}}, "storageClassName"),
        ({"backends": {"zookeeper": {"storageSize": "8Gi"}}}, "storageSize"),  # a misspelt key
    ],
)
def test_values_that_break_the_schema_fail_before_anything_is_made(
    tools: Tools, values: dict[str, Any], field: str
) -> None:
    result = tools.template("casque", values, check=False)
    assert result.returncode != 0, result.stdout
    assert SCHEMA_ERROR in result.stderr and field in result.stderr, result.stderr
    lint = tools.run(tools.helm, "lint", str(CHART), "--values", tools.values_file(values), check=False)
    assert lint.returncode != 0


def test_keyspace_isolation_needs_the_operators_cassandra_credentials_and_a_short_keyspace(tools: Tools) -> None:
    for values, problem in (
        ({**OWN_BACKENDS, "cassandra": {"isolation": "keyspace"}}, "needs cassandra.auth"),
        ({"cassandra": {"isolation": "keyspace", "keyspace": "k" * 25, "auth": {"existingSecret": "c"}}}, "at most 24"),
    ):
        result = tools.template("casque", values, check=False)
        assert result.returncode != 0 and problem in result.stderr, result.stderr
    container = operator_container(tools.render("casque", {"cassandra": {"isolation": "keyspace",
                                                                         "auth": {"existingSecret": "c"}}}))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CASQUE_CASSANDRA_ISOLATION"] == "keyspace"


def key_env(documents: list[dict[str, Any]]) -> dict[str, Any]:
    env = {e["name"]: e for e in operator_container(documents)["env"]}
    return {name: env[name]["valueFrom"]["secretKeyRef"] for name in env if "DERIVATION_KEY" in name}


@pytest.mark.parametrize("values", [
    {"cassandra": {"isolation": "keyspace", "auth": {"username": "casque", "password": "c" * 16}}},
    {"zookeeper": {"auth": {"username": "casque", "password": "z" * 32}}},
], ids=["keyspace-isolation", "zookeeper-auth"])
def test_namespaces_passwords_derive_from_a_random_key_of_its_own_secret(tools: Tools, values: dict[str, Any]) -> None:
    keys = []
    for _ in range(2):
        documents = tools.render("casque", values, release="r")
        secret = next(d for d in documents if d["kind"] == "Secret" and d["metadata"]["name"] == "r-casque-derivation-key")
        key = base64.b64decode(secret["data"]["derivation-key"])
        assert len(key) >= 32 and b"c" * 16 not in key and b"z" * 32 not in key
        assert key_env(documents) == {"CASQUE_DERIVATION_KEY": {"name": "r-casque-derivation-key", "key": "derivation-key"}}
        keys.append(key)
    # Random, not a function of the values (no login password goes into it); `helm upgrade`
    # keeps an installed one (lookup), which `helm template` cannot see.
    assert keys[0] != keys[1]
    own = tools.render("casque", {**values, "derivationKey": {"existingSecret": "mine", "key": "k"}}, release="r")
    assert not [d for d in own if d["kind"] == "Secret" and d["metadata"]["name"] == "r-casque-derivation-key"]
    assert key_env(own) == {"CASQUE_DERIVATION_KEY": {"name": "mine", "key": "k"}}
    # While rotating: the previous key from a Secret of its own, under the same key.
    rotating = tools.render("casque", {**values, "derivationKey": {"previousSecret": "old-key"}}, release="r")
    assert key_env(rotating) == {"CASQUE_DERIVATION_KEY": {"name": "r-casque-derivation-key", "key": "derivation-key"},
                                 "CASQUE_PREVIOUS_DERIVATION_KEY": {"name": "old-key", "key": "derivation-key"}}


def test_without_isolation_or_zookeeper_auth_there_is_no_derivation_key(tools: Tools) -> None:
    plain = tools.render("casque", {**OWN_BACKENDS, "cassandra": {"auth": {"username": "casque", "password": "c" * 16}},
                                    "derivationKey": {"previousSecret": "old-key"}}, release="r")
    assert key_env(plain) == {}
    assert not [d for d in plain if d["metadata"]["name"] == "r-casque-derivation-key"]


def test_the_charts_crds_are_the_crds_directory(tools: Tools, tmp_path: Path) -> None:
    """One source of truth: the chart's crds/ are copies of crds/*.yaml (no links, which helm
    warns of on every command), and its package carries their bytes."""
    copies = sorted((CHART / "crds").iterdir())
    assert [p.name for p in copies] == [p.name for p in CRD_FILES]
    assert not any(p.is_symlink() for p in copies)
    tools.run(tools.helm, "package", str(CHART), "--destination", str(tmp_path))
    (package,) = tmp_path.glob("casque-*.tgz")
    tools.run("tar", "-xzf", str(package), "-C", str(tmp_path))
    for crd in CRD_FILES:
        assert (tmp_path / "casque" / "crds" / crd.name).read_bytes() == crd.read_bytes()


def test_helm_template_needs_no_flags_and_warns_of_nothing(tmp_path: Path) -> None:
    """What a new user types first: no --kube-version, no cluster, nothing on stderr."""
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path / "cache"), "HELM_CONFIG_HOME": str(tmp_path / "config"),
           "HELM_DATA_HOME": str(tmp_path / "data"), "KUBECONFIG": str(tmp_path / "no-cluster")}
    outputs = []
    for command in (["template", "casque", str(CHART), "--include-crds"], ["lint", "--strict", str(CHART)],
                    ["show", "chart", str(CHART)]):
        result = subprocess.run([str(kube_tool("helm")), *command], capture_output=True, text=True, env=env,
                                timeout=120, check=False)
        assert result.returncode == 0 and result.stderr == "", (command, result.stderr)
        outputs.append(result.stdout)
    rendered = [d for d in yaml.safe_load_all(outputs[0]) if d]
    assert {d["kind"] for d in rendered} >= {"Deployment", "CustomResourceDefinition"}


# --- rendering and the API server -------------------------------------------------------------


def test_default_values_are_accepted_by_the_api_server(
    tools: Tools, kube_namespace: str, casque_crds: None  # noqa: F811
) -> None:
    manifest = tools.template(kube_namespace).stdout
    out = tools.dry_run(manifest)
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    kinds = sorted(d["kind"] for d in documents)
    # With the release's own ZooKeeper and Cassandra (backends.embedded, on by default): a
    # StatefulSet, a peers Service, a client Service, a disruption budget and a NetworkPolicy
    # each, and one for the operator (networkPolicy: on by default with embedded backends);
    # their generated logins and the derivation key (three Secrets besides the webhook's), their
    # TLS (the CA with its key, a certificate per backend: three more) and the Role that lets
    # the operator read the certificates' CA to copy it for sidecars, and the admission policy
    # that holds the operator to the namespaces' Secrets it writes.
    assert kinds == sorted([
        "ServiceAccount", "Secret", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service",
        "Service", "Deployment", "PodDisruptionBudget", "MutatingWebhookConfiguration", "NetworkPolicy",
        *["StatefulSet", "Service", "Service", "PodDisruptionBudget", "NetworkPolicy"] * 2,
        *["Secret"] * 3, *["Secret"] * 3, "Role", "RoleBinding",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    ])  # fmt: skip
    assert out.count("(server dry run)") == len(documents), out
    # The CRDs come with the chart (Helm installs crds/ before the templates).
    with_crds = tools.render(kube_namespace, None, "--include-crds")
    assert {d["metadata"]["name"] for d in of_kind(with_crds, "CustomResourceDefinition")} == {
        "queues.casque.io", "subscribers.casque.io"
    }


def test_an_install_tells_the_user_what_to_do_next(
    tools: Tools, kube_namespace: str, casque_crds: None  # noqa: F811
) -> None:
    """`helm install --dry-run=server`: the API server checks the release, Helm prints NOTES.txt."""
    values = tools.values_file({**OWN_BACKENDS,
                                "cassandra": {"auth": {"username": "casque", "password": "s3cret-of-16-chars"}}})
    out = tools.run(
        tools.helm, "install", "shop", str(CHART), "--namespace", kube_namespace, "--dry-run=server",
        "--values", values,
    ).stdout  # fmt: skip
    notes = out[out.index("NOTES:") :]
    assert f"kubectl -n {kube_namespace} rollout status deployment/shop-casque" in notes
    assert "casque.io/inject: \"true\"" in notes and "examples/app-deployment.yaml" in notes
    assert "WARNING: Cassandra needs credentials, but sidecar.credentialsSecret is empty" in notes
    assert "kubectl apply -f crds/" in notes
    assert "It connects to Cassandra at cassandra:9042" in notes and "ZooKeeper at zookeeper:2181" in notes
    assert "Both are yours: this release runs neither (backends.embedded=false)." in notes
    assert "casque.io/backend-access" not in notes  # no policies on backends it does not run


def test_an_install_with_embedded_backends_says_they_run_in_it(
    tools: Tools, kube_namespace: str, casque_crds: None  # noqa: F811
) -> None:
    out = tools.run(
        tools.helm, "install", "shop", str(CHART), "--namespace", kube_namespace, "--dry-run=server",
        "--values", tools.values_file(embedded(3)),
    ).stdout  # fmt: skip
    notes = out[out.index("NOTES:") :]
    assert f"It connects to Cassandra at shop-casque-cassandra.{kube_namespace}.svc.cluster.local:9042" in notes
    assert f"ZooKeeper at shop-casque-zookeeper.{kube_namespace}.svc.cluster.local:2281" in notes
    assert "ZooKeeper with 3 member(s), Cassandra with 3 node(s) in datacenter dc1" in notes
    assert f"kubectl -n {kube_namespace} rollout status statefulset/shop-casque-cassandra" in notes
    assert "this release runs neither" not in notes
    assert "kubectl label namespace shop casque.io/backend-access=true" in notes


@pytest.mark.parametrize("issuer", [None, {"name": "platform-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}],
                         ids=["own-ca", "cluster-issuer"])
def test_cert_manager_mode_renders_the_same_objects_every_time(
    tools: Tools, kube_namespace: str, casque_crds: None, cert_manager_crds: None,  # noqa: F811
    issuer: dict[str, str] | None,
) -> None:
    """With GitOps, `helm template` runs on every sync: nothing random may be in its output, so
    the logins and the derivation key come from Secrets of the user's too (docs/deploy.md)."""
    values = {"injection": {"tls": {"mode": "certManager", "certManager": {"issuerRef": issuer or {}}}},
              **GITOPS_SECRETS}
    manifest = tools.template(kube_namespace, values, release="casque").stdout
    assert tools.template(kube_namespace, values, release="casque").stdout == manifest
    out = tools.dry_run(manifest)
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    assert out.count("(server dry run)") == len(documents), out
    assert not of_kind(documents, "Secret")  # cert-manager writes the webhook's Secret
    certificates = {c["metadata"]["name"]: c["spec"] for c in of_kind(documents, "Certificate")}
    serving = certificates["casque-webhook"]
    service = f"casque-webhook.{kube_namespace}.svc"
    assert serving["dnsNames"] == [service, f"{service}.cluster.local"]
    volumes = one(documents, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-tls", "secret": {"secretName": serving["secretName"]}} in volumes
    configuration = one(documents, "MutatingWebhookConfiguration")
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{kube_namespace}/casque-webhook"
    }
    assert "caBundle" not in configuration["webhooks"][0]["clientConfig"]
    # The embedded backends' certificates come from the same issuer.
    for backend in ("cassandra", "zookeeper"):
        assert certificates[f"casque-{backend}-tls"]["issuerRef"] == serving["issuerRef"]
        assert certificates[f"casque-{backend}-tls"]["dnsNames"][0] == f"casque-{backend}.{kube_namespace}.svc.cluster.local"
    if issuer:
        assert set(certificates) == {"casque-webhook", "casque-cassandra-tls", "casque-zookeeper-tls"}
        assert not of_kind(documents, "Issuer")
        assert serving["issuerRef"] == issuer
    else:  # a CA of the release's own: a self-signed root, and an issuer signing with it
        assert certificates["casque-webhook-ca"]["isCA"]
        assert serving["issuerRef"]["name"] == "casque-webhook-ca"
        issuers = {i["metadata"]["name"] for i in of_kind(documents, "Issuer")}
        assert issuers == {"casque-webhook-selfsigned", "casque-webhook-ca"}


def test_the_external_metrics_api_is_registered_behind_the_webhooks_service_and_readable_by_the_autoscaler(
    tools: Tools, kube_namespace: str, kube_client: client.ApiClient, casque_crds: None,  # noqa: F811
    cert_manager_crds: None,
) -> None:
    """externalMetrics.enabled: an APIService on the webhook's Service and certificate, the
    operator serving it on every replica, and the rights both ends need."""
    release = f"r{uuid.uuid4().hex[:6]}"
    values = {"externalMetrics": {"enabled": True}}
    manifest = tools.template(kube_namespace, values, release=release).stdout
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    assert tools.dry_run(manifest).count("(server dry run)") == len(documents)
    registration = one(documents, "APIService")
    assert registration["metadata"]["name"] == "v1beta1.external.metrics.k8s.io"
    spec = registration["spec"]
    assert (spec["group"], spec["version"]) == ("external.metrics.k8s.io", "v1beta1")
    # The webhook's Service and the CA its certificate is signed with.
    service = named(documents, "Service", spec["service"]["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == spec["service"]["port"]]
    webhook = one(documents, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]
    assert spec["service"]["name"] == webhook["service"]["name"]
    assert spec["caBundle"] == webhook["caBundle"]
    container = operator_container(documents)
    (served,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    _, params = cli_call(container["args"])
    assert params["metrics_api_port"] == served["containerPort"]
    assert (params["metrics_api_cert"], params["metrics_api_key"]) == (params["webhook_cert"], params["webhook_key"])
    operator_policy = named(documents, "NetworkPolicy", f"{release}-casque-operator")
    assert served["containerPort"] in {p["port"] for rule in operator_policy["spec"]["ingress"] for p in rule["ports"]}
    # Off by default: a cluster has one provider of the API.
    assert not of_kind(tools.render(kube_namespace), "APIService")
    refused = tools.template(kube_namespace, {**values, "injection": {"enabled": False}}, check=False)
    assert refused.returncode != 0 and "externalMetrics.enabled needs injection.enabled" in refused.stderr
    # With cert-manager, its CA injector fills the APIService's caBundle as the webhook's.
    issued = tools.render(kube_namespace, {**values, "injection": {"tls": {"mode": "certManager"}}, **GITOPS_SECRETS},
                          release="casque")
    assert one(issued, "APIService")["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{kube_namespace}/casque-webhook"}
    assert "caBundle" not in one(issued, "APIService")["spec"]

    show = ["--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml"]
    rbac = tools.template(kube_namespace, values, *show, release=release).stdout
    tools.run(*tools.kubectl, "apply", "-f", "-", input=rbac)
    try:
        account = f"{release}-casque"
        # The operator reviews who asks, and reads how the front proxy proves itself ...
        assert tools.can_i(kube_namespace, account, "create", "subjectaccessreviews.authorization.k8s.io")
        assert tools.can_i(kube_namespace, account, "get", "configmaps/extension-apiserver-authentication",
                           "kube-system")
        # ... and no other ConfigMap there.
        assert not tools.can_i(kube_namespace, account, "get", "configmaps/kube-proxy", "kube-system")
        # The HPA controller reads the metrics of any namespace; nobody else is given them.
        # (Asked directly: kubectl drops the group of a resource its discovery does not know.)
        authorization = client.AuthorizationV1Api(kube_client)

        def may_read_lag(namespace: str, account: str) -> bool:
            review = authorization.create_subject_access_review({"spec": {
                "user": f"system:serviceaccount:{namespace}:{account}",
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                "resourceAttributes": {"group": "external.metrics.k8s.io", "resource": "casque-subscriber-lag-messages",
                                       "namespace": kube_namespace, "verb": "list"}}})
            return bool(review.status.allowed)
        assert may_read_lag("kube-system", "horizontal-pod-autoscaler")
        assert not may_read_lag(kube_namespace, "default") and not may_read_lag(kube_namespace, account)
    finally:
        tools.run(*tools.kubectl, "delete", "--wait=false", "-f", "-", input=rbac)


def test_an_upgrade_keeps_the_webhook_certificate_and_the_generated_logins(
    tools: Tools, kube_namespace: str, kube_client: client.ApiClient, casque_crds: None  # noqa: F811
) -> None:
    """A real install and upgrades: the generated CA and certificates survive an upgrade, and a
    backend's certificate past half its life is made anew by the next."""
    release = f"r{uuid.uuid4().hex[:6]}"
    # No namespace carries this label, so the (unanswered) webhook never sees a pod.
    values = tools.values_file({"injection": {"namespaceSelector": {"matchLabels": {"casque.io/test": release}}}})
    base = [str(CHART), "--namespace", kube_namespace, "--values", values]
    core = client.CoreV1Api(kube_client)
    admission = client.AdmissionregistrationV1Api(kube_client)
    secret_name, webhook_name = f"{release}-casque-webhook-tls", f"{release}-casque-{kube_namespace}"

    def installed() -> tuple[dict[str, str], str]:
        secret = core.read_namespaced_secret(secret_name, kube_namespace).data
        ca_bundle = admission.read_mutating_webhook_configuration(webhook_name).webhooks[0].client_config.ca_bundle
        return dict(secret), str(ca_bundle)

    def generated() -> dict[str, dict[str, str]]:
        # The embedded backends' logins and the derivation key: a new one would lock the
        # operator out of Cassandra (its role keeps the first password) and rotate every
        # namespace's identities.
        return {name: dict(core.read_namespaced_secret(f"{release}-casque-{name}", kube_namespace).data)
                for name in ("cassandra", "zookeeper", "derivation-key")}

    apps = client.AppsV1Api(kube_client)

    def backend_tls() -> dict[str, tuple[dict[str, str], str]]:
        # Each backend's certificate Secret, and the digest its pods were started with.
        return {backend: (dict(core.read_namespaced_secret(f"{release}-casque-{backend}-tls", kube_namespace).data),
                          apps.read_namespaced_stateful_set(f"{release}-casque-{backend}", kube_namespace)
                          .spec.template.metadata.annotations["casque.io/tls-certificate"])
                for backend in ("cassandra", "zookeeper")}

    tools.run(tools.helm, "install", release, *base)
    try:
        first, ca_bundle = installed()
        assert ca_bundle == first["ca.crt"]
        logins = generated()
        certificates = backend_tls()
        tools.run(tools.helm, "upgrade", release, *base, "--set", "operator.replicas=3")
        assert installed() == (first, ca_bundle)
        assert generated() == logins
        # The backends' certificates are kept too, so their pods do not roll.
        assert backend_tls() == certificates
        deployment = apps.read_namespaced_deployment(f"{release}-casque", kube_namespace)
        assert deployment.spec.replicas == 3
        # Past half its life (as its annotation says), Cassandra's certificate is made anew by
        # the next upgrade, signed by the same CA, and its pods roll; ZooKeeper's stays.
        core.patch_namespaced_secret(f"{release}-casque-cassandra-tls", kube_namespace,
                                     {"metadata": {"annotations": {"casque.io/renew-after": "0"}}})
        tools.run(tools.helm, "upgrade", release, *base, "--set", "operator.replicas=3")
        renewed = backend_tls()
        assert renewed["zookeeper"] == certificates["zookeeper"]
        (data, digest), (old_data, old_digest) = renewed["cassandra"], certificates["cassandra"]
        assert data["tls.crt"] != old_data["tls.crt"] and data["tls.key"] != old_data["tls.key"]
        assert data["ca.crt"] == old_data["ca.crt"] and digest != old_digest
        renew_after = core.read_namespaced_secret(f"{release}-casque-cassandra-tls", kube_namespace).metadata.annotations[
            "casque.io/renew-after"]
        assert int(renew_after) > time.time() + 300 * 86400  # half of 730 days from now
        # Without its CA (deleted to rotate it), the next upgrade makes a CA and both certificates anew.
        core.delete_namespaced_secret(f"{release}-casque-tls-ca-key", kube_namespace)
        tools.run(tools.helm, "upgrade", release, *base, "--set", "operator.replicas=3")
        rotated = backend_tls()
        assert {rotated[b][0]["ca.crt"] for b in rotated} == {
            core.read_namespaced_secret(f"{release}-casque-tls-ca-key", kube_namespace).data["tls.crt"]}
        assert all(rotated[b][0]["ca.crt"] != renewed[b][0]["ca.crt"] and rotated[b][1] != renewed[b][1]
                   for b in rotated)
    finally:
        tools.run(tools.helm, "uninstall", release, "--namespace", kube_namespace, "--wait=false")


def test_the_default_operator_leads_serves_the_webhook_and_is_locked_down(tools: Tools, kube_namespace: str) -> None:  # noqa: F811
    documents = tools.render(kube_namespace, release="shop")
    deployment = one(documents, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(documents)
    path, params = cli_call(container["args"])
    assert path == ("operator", "run")
    assert params["all_namespaces"] and params["leader_election"] and params["lease_name"] == "shop-casque"
    assert params["lease_namespace"] == kube_namespace and params["webhook_port"] == 9443
    assert str(params["webhook_cert"]).startswith("/etc/casque/webhook/")
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == injection.SIDECAR_UID
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    # The webhook's certificate and its CA, and the Service that reaches every replica.
    secret = named(documents, "Secret", "shop-casque-webhook-tls")
    webhook = one(documents, "MutatingWebhookConfiguration")["webhooks"][0]
    assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    assert webhook["clientConfig"]["service"]["path"] == "/inject"
    assert webhook["failurePolicy"] == "Ignore" and webhook["sideEffects"] == "None"
    assert kube_namespace in webhook["namespaceSelector"]["matchExpressions"][0]["values"]
    (service,) = [s for s in of_kind(documents, "Service") if s["metadata"]["name"] == "shop-casque-webhook"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert not of_kind(documents, "ServiceMonitor")


def test_non_default_values_are_accepted_by_the_api_server(
    tools: Tools,
    kube_namespace: str,  # noqa: F811
    other_namespace: str,
    casque_crds: None,
    service_monitor_crd: None,
    kube_cluster: KubeCluster,  # noqa: F811
) -> None:
    values = {
        **NON_DEFAULT,
        "operator": {**NON_DEFAULT["operator"], "watchNamespaces": [kube_namespace, other_namespace]},
        "injection": {
            **NON_DEFAULT["injection"],
            "tls": {"mode": "secret", "existingSecret": "casque-webhook-tls", "caBundle": kube_cluster.ca_bundle},
        },
        "networkPolicy": {
            **NON_DEFAULT["networkPolicy"],
            "backends": {**NON_DEFAULT["networkPolicy"]["backends"], "namespace": other_namespace},
        },
    }
    manifest = tools.template(kube_namespace, values).stdout
    out = tools.dry_run(manifest)
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    assert out.count("(server dry run)") == len(documents), out

    # Roles in the watched namespaces; cluster-wide only what kopf's discovery needs.
    roles = [r for r in of_kind(documents, "Role") if not r["metadata"]["name"].endswith(("leader-election",
                                                                                             "secret-sources"))]
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted([kube_namespace, other_namespace])
    # The sidecar's Secrets, read by name where they are kept, to be copied where pods are.
    (sources,) = [r for r in of_kind(documents, "Role") if r["metadata"]["name"].endswith("secret-sources")]
    assert sources["metadata"]["namespace"] == kube_namespace
    assert sources["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
                                 "resourceNames": ["casque-cassandra", "cassandra-tls", "zookeeper-tls"]}]
    cluster_rules = one(documents, "ClusterRole")["rules"]
    assert {g for rule in cluster_rules for g in rule["apiGroups"]} == {"apiextensions.k8s.io", ""}
    assert not any("events" in rule["resources"] for rule in cluster_rules)
    # A certificate of the user's: no Secret made for it, its CA in the configuration.
    secrets = sorted(s["metadata"]["name"].rsplit("-", 1)[1] for s in of_kind(documents, "Secret"))
    # Only the backends' installation identities and, with ZooKeeper auth on, the derivation key
    # the namespaces' identities derive from (<release>-derivation-key).
    assert secrets == ["cassandra", "key", "zookeeper"]
    webhook = one(documents, "MutatingWebhookConfiguration")["webhooks"][0]
    assert webhook["clientConfig"]["caBundle"] == kube_cluster.ca_bundle
    assert webhook["failurePolicy"] == "Fail"
    assert webhook["namespaceSelector"]["matchLabels"] == {"casque.io/injection": "enabled"}
    assert webhook["objectSelector"] == NON_DEFAULT["injection"]["objectSelector"]
    monitor = one(documents, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # The subscriber gauges' own namespace label survives the scrape (the alerts group by it).
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    # Every injected sidecar, in every namespace, on the port the webhook names.
    sidecars = one(documents, "PodMonitor")["spec"]
    assert sidecars["selector"]["matchLabels"] == {injection.SIDECAR_LABEL: injection.SIDECAR_LABEL_VALUE}
    assert sidecars["namespaceSelector"] == {"any": True}
    assert sidecars["podMetricsEndpoints"][0]["port"] == injection.METRICS_PORT_NAME
    assert sidecars["podMetricsEndpoints"][0]["interval"] == "15s"
    assert one(documents, "PodDisruptionBudget")["spec"]["maxUnavailable"] == "50%"

    container = operator_container(documents)
    assert container["image"] == f"registry.example.com/platform/casque/operator@sha256:{'ab' * 32}"
    path, params = cli_call(container["args"])
    assert params["namespace"] == [kube_namespace, other_namespace] and not params["all_namespaces"]
    assert params["lease_name"] == "shop-operator" and params["lease_duration"] == 20 and params["verbose"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["CASQUE_CASSANDRA_USERNAME"]["secretKeyRef"]["key"] == "username"
    assert env["CASQUE_ZOOKEEPER_PASSWORD"]["secretKeyRef"]["key"] == "password"
    assert (env["CASQUE_QUOTA_MAX_QUEUES"], env["CASQUE_QUOTA_MAX_RETENTION"]) == ("20", "14d")
    assert env["CASQUE_INJECTION_IMAGE"] == "registry.example.com/platform/casque/sidecar:0.1.0-rc1"
    pod = one(documents, "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"]["example.com/team"] == "platform"
    assert "checksum/cassandra-credentials" in pod["metadata"]["annotations"]

    # NetworkPolicies: the operator takes only its own ports and reaches only DNS, the API
    # server and the backends' client ports; the backends admit the operator and sidecars.
    policies = {p["metadata"]["name"].rsplit("-", 1)[1]: p for p in of_kind(documents, "NetworkPolicy")}
    assert set(policies) == {"operator", "cassandra", "zookeeper"}
    operator_policy = policies["operator"]
    assert operator_policy["spec"]["podSelector"] == one(documents, "Deployment")["spec"]["selector"]
    assert {p["port"] for rule in operator_policy["spec"]["ingress"] for p in rule["ports"]} == {8080, 9443, 9090}
    (metrics_rule,) = [r for r in operator_policy["spec"]["ingress"] if r["ports"][0]["port"] == 9090]
    assert metrics_rule["from"] == NON_DEFAULT["networkPolicy"]["metricsFrom"]
    egress = {p["port"]: rule.get("to") for rule in operator_policy["spec"]["egress"] for p in rule["ports"]}
    assert set(egress) == {53, 443, 6443, 9142, 2181} and egress[443] == [{"ipBlock": {"cidr": "10.96.0.1/32"}}]
    for backend, port in (("cassandra", 9142), ("zookeeper", 2181)):
        policy = policies[backend]
        assert policy["metadata"]["namespace"] == other_namespace
        clients, peers = policy["spec"]["ingress"]
        assert [p["port"] for p in clients["ports"]] == [port]
        # Sidecars in the watched namespaces, by the name the API server gives each namespace.
        watched = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [kube_namespace, other_namespace]}
        sidecars = {"namespaceSelector": {"matchExpressions": [watched]},
                    "podSelector": {"matchLabels": {"casque.io/sidecar": "injected"}}}
        assert sidecars in clients["from"]
        assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": kube_namespace}},
                "podSelector": operator_policy["spec"]["podSelector"]} in clients["from"]
        assert {"podSelector": {"matchLabels": {"spark-role": "executor"}}} in clients["from"]
        assert "ports" not in peers and peers["from"] == [{"podSelector": policy["spec"]["podSelector"]}]


def test_minimal_values_are_accepted_by_the_api_server(
    tools: Tools, kube_namespace: str, casque_crds: None  # noqa: F811
) -> None:
    manifest = tools.template(kube_namespace, MINIMAL).stdout
    out = tools.dry_run(manifest)
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    assert out.count("(server dry run)") == len(documents), out
    assert sorted(d["kind"] for d in documents) == ["Deployment"]
    container = operator_container(documents)
    _, params = cli_call(container["args"])
    assert params["leader_election"] is False and params["webhook_port"] is None and params["metrics_port"] is None
    assert container["readinessProbe"]["httpGet"]["port"] == "liveness"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["CASQUE_CASSANDRA_PASSWORD"] == {"secretKeyRef": {"name": "cassandra-credentials", "key": "pass"}}
    assert one(documents, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "casque-operator"


# --- the backends the release runs (backends.embedded) -----------------------------------------


def embedded(replicas: int, **backends: Any) -> dict[str, Any]:
    return {"backends": {"embedded": True, "zookeeper": {"replicas": replicas}, "cassandra": {"replicas": replicas},
                         **backends}}


def named(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in of_kind(documents, kind) if d["metadata"]["name"] == name]
    return found


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def operator_backends(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The backends the operator reads from the chart's environment, and gives its sidecars."""
    for name in [n for n in os.environ if n.startswith("CASQUE_")]:
        monkeypatch.delenv(name)
    for name, value in stand_in_env(container).items():
        monkeypatch.setenv(name, value)
    return Settings()


def stand_in_env(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment, each value read from a Secret replaced by a stand-in as long
    as a generated one (the settings check lengths, and need a password with isolation)."""
    return {e["name"]: e["value"] if "value" in e else "s" * 48 for e in container["env"]}


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_embedded_backends_are_accepted_by_the_api_server(
    tools: Tools, kube_namespace: str, casque_crds: None, replicas: int, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    tmp_path: Path,
) -> None:
    manifest = tools.template(kube_namespace, embedded(replicas), release="shop").stdout
    out = tools.dry_run(manifest)
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    assert out.count("(server dry run)") == len(documents), out
    assert sorted(d["metadata"]["name"] for d in of_kind(documents, "StatefulSet")) == ["shop-casque-cassandra",
                                                                                      "shop-casque-zookeeper"]
    domain = f"{kube_namespace}.svc.cluster.local"

    for backend, ports, policy in (("zookeeper", {2888, 3888, 2281}, "Parallel"),
                                   ("cassandra", {7000, 9042}, "OrderedReady")):  # fmt: skip
        name = f"shop-casque-{backend}"
        statefulset = named(documents, "StatefulSet", name)["spec"]
        pod = statefulset["template"]["spec"]
        labels = statefulset["template"]["metadata"]["labels"]
        assert statefulset["replicas"] == replicas and statefulset["podManagementPolicy"] == policy
        assert statefulset["serviceName"] == f"{name}-peers"
        assert selects(statefulset["selector"]["matchLabels"], labels)
        assert labels["app.kubernetes.io/name"] == backend  # what networkPolicy.backends selects by default
        # Members find each other by name before they are ready.
        peers = named(documents, "Service", f"{name}-peers")["spec"]
        assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
        assert {p["port"] for p in peers["ports"]} == ports and selects(peers["selector"], labels)
        client_service = named(documents, "Service", name)["spec"]
        assert selects(client_service["selector"], labels) and "publishNotReadyAddresses" not in client_service
        budget = named(documents, "PodDisruptionBudget", name)["spec"]
        assert budget["maxUnavailable"] == 1 and budget["selector"]["matchLabels"] == statefulset["selector"]["matchLabels"]
        # A member unready only because its probe timed out still votes: evicted while the
        # others are healthy only, so a drain never breaks the quorum.
        assert budget["unhealthyPodEvictionPolicy"] == "IfHealthyBudget"
        # Locked down like casque's own pods.
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                          "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
        (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == statefulset["selector"]["matchLabels"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]} and context["runAsNonRoot"] is True
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            assert container["image"] == f"casque-{backend}:0.1.0" and container["imagePullPolicy"] == "IfNotPresent"
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]] and any("log" in path and "emptyDir" in volumes[v]
                                                             for path, v in mounts.items())
        (claim,) = statefulset["volumeClaimTemplates"]
        assert claim["metadata"]["name"] in mounts.values()
        assert "storageClassName" not in claim["spec"]  # the cluster's default class

    zookeeper = named(documents, "StatefulSet", "shop-casque-zookeeper")["spec"]["template"]["spec"]
    (member,) = zookeeper["containers"]
    env = {e["name"]: e.get("value") for e in member["env"]}
    peers = f"shop-casque-zookeeper-peers.{domain}"
    assert env["ZOO_SERVERS"].split() == [
        f"server.{i + 1}=shop-casque-zookeeper-{i}.{peers}:2888:3888;2181" for i in range(replicas)
    ]
    assert member["readinessProbe"]["exec"]["command"] == ["/opt/zookeeper/bin/serving"]
    (myid,) = zookeeper["initContainers"]
    assert "${HOSTNAME##*-} + 1" in myid["command"][-1] and "/myid" in myid["command"][-1]
    assert named(documents, "Service", "shop-casque-zookeeper")["spec"]["type"] == "ClusterIP"

    cassandra = named(documents, "StatefulSet", "shop-casque-cassandra")["spec"]["template"]["spec"]
    (node,) = cassandra["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in node["env"]}
    assert env["CASSANDRA_SEEDS"] == f"shop-casque-cassandra-0.shop-casque-cassandra-peers.{domain}"
    assert (env["CASSANDRA_CLUSTER_NAME"], env["CASSANDRA_DC"]) == ("shop-casque", "dc1")
    assert env["MAX_HEAP_SIZE"] == "1024M"  # half of the 2Gi limit
    assert node["readinessProbe"]["tcpSocket"] == {"port": "cql"}
    assert named(documents, "Service", "shop-casque-cassandra")["spec"]["clusterIP"] == "None"

    # The operator, and through its settings every sidecar it injects, use the embedded Services.
    settings = operator_backends(operator_container(documents), monkeypatch)
    assert settings.cassandra_contact_points == [f"shop-casque-cassandra.{domain}"]
    assert settings.cassandra_port == 9042 and settings.cassandra_local_dc == "dc1"
    assert settings.zookeeper_hosts == f"shop-casque-zookeeper.{domain}:2281"
    assert settings.replication.strategy == "NetworkTopologyStrategy"
    assert settings.replication.datacenters == {"dc1": replicas}
    settings.replication.cql_map()
    request = injection.SidecarRequest(queue="orders", subscribers=("billing",), port=8717, token_secret=None)
    sidecar = injection.sidecar_container(request, injection.InjectionSettings(), settings, "shop")
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert sidecar_env["CASQUE_CASSANDRA_CONTACT_POINTS"] == f"shop-casque-cassandra.{domain}"
    assert sidecar_env["CASQUE_ZOOKEEPER_HOSTS"] == f"shop-casque-zookeeper.{domain}:2281"

    # TLS to both (backends.tls): clients trust the CA of the certificates' Secrets and check
    # the client Service's name; each backend's pods mount their own certificate.
    assert settings.cassandra_tls.enabled and settings.zookeeper_tls.enabled
    assert settings.cassandra_tls.verify_hostname and settings.zookeeper_tls.verify_hostname
    assert settings.cassandra_tls.server_hostname == f"shop-casque-cassandra.{domain}"
    for backend, variable in (("cassandra", "CASSANDRA_TLS_DIR"), ("zookeeper", "ZOO_TLS_DIR")):
        name = f"shop-casque-{backend}-tls"
        pem = tmp_path / backend
        pem.mkdir()
        for key, value in named(documents, "Secret", name)["data"].items():
            (pem / key).write_bytes(base64.b64decode(value))
        assert sorted(p.name for p in pem.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
        verified = subprocess.run(["openssl", "verify", "-CAfile", str(pem / "ca.crt"), str(pem / "tls.crt")],
                                  capture_output=True, text=True, check=False)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        names = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(pem / "tls.crt")],
                               capture_output=True, text=True, check=True).stdout
        assert re.findall(r"DNS:([^,\s]+)", names) == [f"shop-casque-{backend}.{domain}",
                                                       f"*.shop-casque-{backend}-peers.{domain}"]
        template = named(documents, "StatefulSet", f"shop-casque-{backend}")["spec"]["template"]
        assert {"name": variable, "value": "/etc/casque-tls"} in template["spec"]["containers"][0]["env"]
        assert {"name": "tls", "secret": {"secretName": name, "defaultMode": 0o440}} in template["spec"]["volumes"]
        # A new certificate rolls the pods.
        digest = hashlib.sha256((pem / "tls.crt").read_bytes()).hexdigest()[:16]
        assert template["metadata"]["annotations"]["casque.io/tls-certificate"] == digest
        assert (settings.cassandra_tls if backend == "cassandra" else settings.zookeeper_tls).ca_file == Path(
            f"/etc/casque/tls/{backend}/ca.crt")
        assert {"name": f"{backend}-tls", "secret": {"secretName": name, "defaultMode": 0o440}} in one(
            documents, "Deployment")["spec"]["template"]["spec"]["volumes"]


def test_the_backends_servers_take_jvm_options_from_the_values_and_none_by_default(tools: Tools) -> None:
    def java_tool_options(values: dict[str, Any]) -> dict[str, str | None]:
        documents = tools.render("shop", values, release="shop")
        found = {}
        for backend in ("zookeeper", "cassandra"):
            (server,) = named(documents, "StatefulSet", f"shop-casque-{backend}")["spec"]["template"]["spec"]["containers"]
            found[backend] = {e["name"]: e.get("value") for e in server["env"]}.get("JAVA_TOOL_OPTIONS")
        return found

    assert java_tool_options(embedded(1)) == {"zookeeper": None, "cassandra": None}
    options = embedded(1, zookeeper={"javaToolOptions": "-XX:TieredStopAtLevel=1"},
                       cassandra={"javaToolOptions": "-Xlog:gc:file=/logs/gc.log -XX:+UseParallelGC"})
    assert java_tool_options(options) == {"zookeeper": "-XX:TieredStopAtLevel=1",
                                          "cassandra": "-Xlog:gc:file=/logs/gc.log -XX:+UseParallelGC"}


def test_the_network_policies_cover_the_embedded_backends_by_default(tools: Tools) -> None:
    documents = tools.render("casque", embedded(3), release="shop")
    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(documents, "NetworkPolicy")}
    assert set(policies) == {"shop-casque-operator", "shop-casque-cassandra", "shop-casque-zookeeper"}
    egress = {p["port"] for rule in policies["shop-casque-operator"]["egress"] for p in rule["ports"]}
    assert {9042, 2281} <= egress
    operator = named(documents, "Deployment", "shop-casque")["spec"]["selector"]
    for backend, port in (("cassandra", 9042), ("zookeeper", 2281)):
        labels = named(documents, "StatefulSet", f"shop-casque-{backend}")["spec"]["template"]["metadata"]["labels"]
        policy = policies[f"shop-casque-{backend}"]
        assert selects(policy["podSelector"]["matchLabels"], labels)
        clients, peers = policy["ingress"]
        assert [p["port"] for p in clients["ports"]] == [port] and "ports" not in peers  # quorum, gossip
        # The operator's pods in the release's namespace (its name, set by the API server), and
        # sidecars only in namespaces labelled as clients: a pod can set its own labels, not
        # its namespace's.
        assert clients["from"] == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "casque"}}, "podSelector": operator},
            {"namespaceSelector": {"matchLabels": {"casque.io/backend-access": "true"}},
             "podSelector": {"matchLabels": {"casque.io/sidecar": "injected"}}},
        ]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"networkPolicy": {"enabled": False, "backends": {"enabled": False}}}, set()),
        ({"networkPolicy": {"backends": {"enabled": False}}}, {"operator"}),
        ({"networkPolicy": {"enabled": False}}, {"cassandra", "zookeeper"}),
    ],
    ids=["both-off", "operator-only", "backends-only"],
)
def test_the_network_policies_can_be_turned_off(tools: Tools, values: dict[str, Any], expected: set[str]) -> None:
    documents = tools.render("casque", {**embedded(1), **values}, release="shop")
    assert {p["metadata"]["name"].removeprefix("shop-casque-") for p in of_kind(documents, "NetworkPolicy")} == expected


def test_the_client_namespaces_by_name_or_any(tools: Tools) -> None:
    """Names win over the label selector; an empty selector (no names) admits every namespace."""
    for clients, selector in (
        ({"namespaces": ["shop", "billing"]},
         {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["shop", "billing"]}]}),
        ({"namespaceSelector": {}}, {}),
    ):  # fmt: skip
        values = {**embedded(1), "networkPolicy": {"backends": {"clients": clients}}}
        (policy,) = [p for p in of_kind(tools.render("casque", values, release="shop"), "NetworkPolicy")
                     if p["metadata"]["name"] == "shop-casque-cassandra"]
        assert policy["spec"]["ingress"][0]["from"][1]["namespaceSelector"] == selector


def test_without_embedded_backends_nothing_of_them_is_made(tools: Tools, monkeypatch: pytest.MonkeyPatch) -> None:
    documents = tools.render("casque", OWN_BACKENDS, release="shop")
    assert not of_kind(documents, "StatefulSet")
    # Nor NetworkPolicies by default: where the backends are, and who reaches them, is yours.
    assert not of_kind(documents, "NetworkPolicy")
    assert not [d for d in documents if "cassandra" in d["metadata"]["name"] or "zookeeper" in d["metadata"]["name"]]
    settings = operator_backends(operator_container(documents), monkeypatch)
    assert (settings.cassandra_contact_points, settings.zookeeper_hosts) == (["cassandra"], "zookeeper:2181")
    # An ensemble of your own may serve other applications: its / and /zookeeper stay as they are.
    assert not settings.zookeeper_owned_ensemble


def test_the_embedded_keyspace_has_a_replica_per_node_up_to_three(tools: Tools) -> None:
    """Through casque.replication, whatever cassandra.replication says (it is for your own clusters)."""
    for replicas, datacenters in ((1, {"ring": 1}), (3, {"ring": 3})):
        values = embedded(replicas, cassandra={"replicas": replicas, "datacenter": "ring"})
        values["cassandra"] = {"replication": {"strategy": "SimpleStrategy", "factor": 2}}
        env = {e["name"]: e.get("value") for e in operator_container(tools.render("casque", values))["env"]}
        assert env["CASQUE_REPLICATION_STRATEGY"] == "NetworkTopologyStrategy"
        assert "CASQUE_REPLICATION_FACTOR" not in env
        assert json.loads(env["CASQUE_REPLICATION_DATACENTERS"]) == datacenters
        assert env["CASQUE_CASSANDRA_LOCAL_DC"] == "ring"


@pytest.mark.parametrize(("storage_class", "expected"), [(None, None), ("", ""), ("fast-ssd", "fast-ssd")],
                         ids=["default-class", "no-provisioning", "named"])
def test_the_embedded_backends_storage_class(
    tools: Tools, kube_namespace: str, storage_class: str | None, expected: str | None  # noqa: F811
) -> None:
    """null leaves storageClassName out (the cluster's default class); "" keeps it, empty (no
    dynamic provisioning): two different requests to Kubernetes."""
    storage = {"storage": {"size": "3Gi", "storageClassName": storage_class}}
    values = embedded(1, zookeeper={"replicas": 1, **storage}, cassandra={"replicas": 1, **storage})
    manifest = tools.template(kube_namespace, values).stdout
    documents = [d for d in yaml.safe_load_all(manifest) if d]
    statefulsets = of_kind(documents, "StatefulSet")
    assert len(statefulsets) == 2
    for statefulset in statefulsets:
        (claim,) = statefulset["spec"]["volumeClaimTemplates"]
        assert claim["spec"].get("storageClassName", "absent") == ("absent" if expected is None else expected)
        assert claim["spec"]["resources"]["requests"]["storage"] == "3Gi"
    out = tools.dry_run(manifest)
    assert out.count("(server dry run)") == len(documents), out


@pytest.mark.parametrize(("values", "names"), [
    ({"cassandra": {"contactPoints": ["cassandra-0.db"]}}, "cassandra.contactPoints"),
    ({"cassandra": {"port": 9142}}, "cassandra.port"),
    ({"cassandra": {"localDatacenter": "east"}}, "cassandra.localDatacenter"),
    ({"zookeeper": {"connect": "zk-0.db:2181"}}, "zookeeper.connect"),
    ({"cassandra": {"tls": {"enabled": True}}}, "cassandra.tls"),
    ({"zookeeper": {"tls": {"enabled": True}}}, "zookeeper.tls"),
    ({"zookeeper": {"auth": {"username": "casque", "password": "z" * 32, "sasl": True}}}, "zookeeper.auth.sasl"),
    ({"cassandra": {"contactPoints": ["c"], "tls": {"enabled": True}}, "zookeeper": {"connect": "z:2181"}},
     "cassandra.contactPoints, zookeeper.connect, cassandra.tls"),
], ids=["contact-points", "port", "local-dc", "connect", "cassandra-tls", "zookeeper-tls", "sasl", "several"])
def test_embedded_backends_refuse_settings_meant_for_external_ones(
    tools: Tools, values: dict[str, Any], names: str
) -> None:
    result = tools.template("casque", {**embedded(1), **values}, check=False)
    assert result.returncode != 0, result.stdout
    assert (f"backends.embedded=true runs Cassandra and ZooKeeper in the release, with TLS of its own (backends.tls) and without SASL, so "
            f"{names} must be left unset (or set backends.embedded=false to use your own clusters)") in result.stderr
    # The same settings are fine for clusters of your own.
    tools.template("casque", {**values, **OWN_BACKENDS})


def secret_data(documents: list[dict[str, Any]], name: str) -> dict[str, str]:
    return {key: base64.b64decode(value).decode() for key, value in named(documents, "Secret", name)["data"].items()}


def secret_ref(container: dict[str, Any], name: str) -> dict[str, str]:
    (entry,) = [e for e in container["env"] if e["name"] == name]
    return dict(entry["valueFrom"]["secretKeyRef"])


def test_the_embedded_backends_are_locked_by_default(tools: Tools) -> None:
    """Secure by default (issue 31): Cassandra checks logins and grants, the installation's
    login and ZooKeeper identity are random and generated, the operator's pods replace
    Cassandra's default superuser before the operator starts, and namespaces are isolated."""
    documents = tools.render("casque", None, release="shop")
    cassandra_login, zookeeper_login = secret_data(documents, "shop-casque-cassandra"), secret_data(
        documents, "shop-casque-zookeeper")
    for login in (cassandra_login, zookeeper_login):
        assert login["username"] == "casque" and len(login["password"]) >= 32
    assert cassandra_login["password"] != zookeeper_login["password"]
    assert len(secret_data(documents, "shop-casque-derivation-key")["derivation-key"]) >= 32

    node = named(documents, "StatefulSet", "shop-casque-cassandra")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in node["env"]}
    assert (env["CASSANDRA_AUTHENTICATOR"], env["CASSANDRA_AUTHORIZER"]) == ("PasswordAuthenticator",
                                                                           "CassandraAuthorizer")
    # A new release's backends talk to their own peers over TLS too (no release to keep as it runs).
    member = named(documents, "StatefulSet", "shop-casque-zookeeper")["spec"]["template"]["spec"]["containers"][0]
    assert env["CASSANDRA_INTERNODE_TLS"] == "true"
    assert {e["name"]: e.get("value") for e in member["env"]}["ZOO_QUORUM_TLS"] == "true"
    for certificate in (secret_data(documents, f"shop-casque-{backend}-tls")["tls.crt"]
                        for backend in ("cassandra", "zookeeper")):
        usages = subprocess.run(["openssl", "x509", "-noout", "-ext", "extendedKeyUsage"], input=certificate,
                                capture_output=True, text=True, check=True).stdout
        assert "TLS Web Server Authentication" in usages and "TLS Web Client Authentication" in usages
    plain = tools.render("casque", {"backends": {"tls": {"internode": False}}}, release="shop")
    assert not [e for d in of_kind(plain, "StatefulSet") for c in d["spec"]["template"]["spec"]["containers"]
                for e in c["env"] if e["name"] in ("CASSANDRA_INTERNODE_TLS", "ZOO_QUORUM_TLS")]
    pod = one(documents, "Deployment")["spec"]["template"]
    (init,) = pod["spec"]["initContainers"]
    path, params = cli_call(init["args"])
    assert path == ("secure-cassandra",) and params["wait"] == 600
    assert init["image"] == operator_container(documents)["image"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    login_ref = {"name": "shop-casque-cassandra", "key": "username"}
    assert secret_ref(init, "CASQUE_CASSANDRA_USERNAME") == login_ref
    init_env = {e["name"]: e.get("value") for e in init["env"]}
    # system_auth gets the keyspace's replication: a replica per node, at most three.
    assert json.loads(init_env["CASQUE_REPLICATION_DATACENTERS"]) == {"dc1": 1}

    container = operator_container(documents)
    assert secret_ref(container, "CASQUE_CASSANDRA_USERNAME") == login_ref
    assert secret_ref(container, "CASQUE_ZOOKEEPER_PASSWORD") == {"name": "shop-casque-zookeeper", "key": "password"}
    assert secret_ref(container, "CASQUE_DERIVATION_KEY") == {"name": "shop-casque-derivation-key",
                                                              "key": "derivation-key"}
    literal = {e["name"]: e.get("value") for e in container["env"]}
    assert literal["CASQUE_CASSANDRA_ISOLATION"] == "keyspace"
    # The ensemble is the installation's: / and /zookeeper closed, a namespace's znodes bounded.
    assert literal["CASQUE_ZOOKEEPER_OWNED_ENSEMBLE"] == "true"
    assert (literal["CASQUE_QUOTA_MAX_ZNODES"], literal["CASQUE_QUOTA_MAX_ZNODE_BYTES"]) == ("100000", "67108864")
    # ...and its keyspace's bytes on disk.
    assert literal["CASQUE_QUOTA_MAX_STORED_BYTES"] == "8589934592"
    assert "CASQUE_QUOTA_MAX_WRITES_PER_SECOND" not in literal  # no write-rate limit unless asked
    # A new login restarts the operator.
    assert "checksum/cassandra-credentials" in pod["metadata"]["annotations"]


def test_the_embedded_backends_can_be_opened_setting_by_setting(tools: Tools) -> None:
    open_zookeeper = tools.render("casque", embedded(1, zookeeper={"replicas": 1, "auth": False}), release="shop")
    assert not [d for d in of_kind(open_zookeeper, "Secret") if d["metadata"]["name"] == "shop-casque-zookeeper"]
    assert "CASQUE_ZOOKEEPER_USERNAME" not in {e["name"] for e in operator_container(open_zookeeper)["env"]}
    no_logins = {"backends": {"embedded": True, "cassandra": {"authenticator": "AllowAllAuthenticator",
                                                              "authorizer": "AllowAllAuthorizer"}}}
    documents = tools.render("casque", no_logins, release="shop")
    assert "initContainers" not in one(documents, "Deployment")["spec"]["template"]["spec"]
    assert not [d for d in of_kind(documents, "Secret") if d["metadata"]["name"] == "shop-casque-cassandra"]
    literal = {e["name"]: e.get("value") for e in operator_container(documents)["env"]}
    assert literal["CASQUE_CASSANDRA_ISOLATION"] == "none"  # auto: nothing to isolate with
    # The user's own login instead of the chart's: the init container makes it the superuser.
    own = tools.render("casque", {"cassandra": {"auth": {"existingSecret": "mine"}}}, release="shop")
    (init,) = one(own, "Deployment")["spec"]["template"]["spec"]["initContainers"]
    assert secret_ref(init, "CASQUE_CASSANDRA_PASSWORD") == {"name": "mine", "key": "password"}
    assert not [d for d in of_kind(own, "Secret") if d["metadata"]["name"] == "shop-casque-cassandra"]


@pytest.mark.parametrize(("values", "sentence"), [
    ({"backends": {"cassandra": {"authenticator": "AllowAllAuthenticator"}}, "cassandra": {"isolation": "keyspace"}},
     "cassandra.isolation=keyspace needs logins: backends.cassandra.authenticator=AllowAllAuthenticator has none"),
    ({"cassandra": {"isolation": "none"}},
     "cassandra.isolation=none with the embedded Cassandra's PasswordAuthenticator leaves sidecars without a login"),
    ({"cassandra": {"auth": {"username": "cassandra", "password": "c" * 16}}},
     "cassandra.auth.username cannot be cassandra with backends.embedded=true"),
], ids=["keyspace-without-logins", "sidecars-without-login", "default-superuser"])
def test_embedded_backends_refuse_logins_that_cannot_work(tools: Tools, values: dict[str, Any], sentence: str) -> None:
    result = tools.template("casque", values, check=False)
    assert result.returncode != 0 and sentence in result.stderr, result.stderr
    # Sidecars with a login of the user's own are fine without isolation.
    if values == {"cassandra": {"isolation": "none"}}:
        tools.template("casque", {**values, "sidecar": {"credentialsSecret": "casque-cassandra"}})


def test_embedded_backends_take_the_external_defaults_or_empty_addresses(tools: Tools) -> None:
    """checkBackends cannot tell a default from a value set to it: it takes the defaults of
    values.yaml as unset. If those defaults change, it must change with them."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert defaults["cassandra"]["contactPoints"] == ["cassandra"] and defaults["cassandra"]["port"] == 9042
    assert defaults["zookeeper"]["connect"] == "zookeeper:2181" and defaults["backends"]["embedded"] is True
    as_defaults = {"cassandra": {"contactPoints": ["cassandra"], "port": 9042, "localDatacenter": "dc1"},
                   "zookeeper": {"connect": "zookeeper:2181", "auth": {"username": "casque", "password": "z" * 32}}}
    for values in ({}, as_defaults, {"cassandra": {"contactPoints": []}, "zookeeper": {"connect": ""}}):
        documents = tools.render("casque", {**embedded(3), **values}, release="casque")
        env = {e["name"]: e.get("value") for e in operator_container(documents)["env"]}
        assert env["CASQUE_CASSANDRA_CONTACT_POINTS"].startswith("casque-cassandra.casque.svc")
        assert env["CASQUE_ZOOKEEPER_HOSTS"].startswith("casque-zookeeper.casque.svc")
    missing = embedded(1, cassandra={"replicas": 1, "resources": {"limits": None}})  # null: Helm drops the default
    result = tools.template("casque", missing, check=False)
    assert result.returncode != 0 and "backends.cassandra.resources.limits.memory is needed" in result.stderr


@pytest.mark.parametrize(("values", "sentence"), [
    ({"cassandra": {"contactPoints": []}}, "cassandra.contactPoints is empty: name your Cassandra nodes there, "
                                           "or set backends.embedded=true to run Cassandra in the release"),
    ({"zookeeper": {"connect": ""}}, "zookeeper.connect is empty: give your ZooKeeper ensemble's host:port list "
                                     "there, or set backends.embedded=true to run ZooKeeper in the release"),
], ids=["contact-points", "connect"])
def test_without_embedded_backends_the_addresses_are_needed(
    tools: Tools, values: dict[str, Any], sentence: str
) -> None:
    result = tools.template("casque", {**values, **OWN_BACKENDS}, check=False)
    assert result.returncode != 0 and sentence in result.stderr, result.stderr


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["default", "non-default"])
def test_the_operator_reads_every_setting_the_chart_gives_it(
    tools: Tools, values: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = operator_container(tools.render("casque", values))
    literal = stand_in_env(container)
    names = {e["name"] for e in container["env"]}
    known = {"POD_NAMESPACE"}
    for prefix, settings in (
        ("CASQUE_", Settings), ("CASQUE_REPLICATION_", ReplicationSettings),
        ("CASQUE_OPERATOR_", OperatorOptions), ("CASQUE_INJECTION_", injection.InjectionSettings),
        ("CASQUE_QUOTA_", QuotaSettings), ("CASQUE_CASSANDRA_TLS_", CassandraTlsSettings),
        ("CASQUE_ZOOKEEPER_TLS_", ZooKeeperTlsSettings),
    ):  # fmt: skip
        known |= {f"{prefix}{field.upper()}" for field in settings.model_fields}
    assert names <= known, names - known
    for name in [n for n in os.environ if n.startswith("CASQUE_")]:
        monkeypatch.delenv(name)
    for name, value in literal.items():
        monkeypatch.setenv(name, value)
    backends = Settings()
    backends.replication.cql_map()  # valid replication for the keyspace the operator creates
    sidecar = injection.InjectionSettings()
    OperatorOptions()
    quotas = QuotaSettings()
    if values:
        assert (quotas.max_queues, quotas.max_shard_priorities, quotas.max_retention) == (20, 64, "14d")
        assert quotas.max_writes_per_second == 500
        assert backends.cassandra_contact_points == ["cassandra-0.cassandra", "cassandra-1.cassandra"]
        assert backends.replication.strategy == "SimpleStrategy" and backends.zookeeper_root == "/shop/casque"
        assert sidecar.native_sidecar is False and sidecar.cpu_limit == "1" and sidecar.credentials_secret
        assert sidecar.metrics_port == 9800
        # TLS files where the Deployment mounts each backend's Secret; sidecars mount their
        # namespace's copy of the same Secret.
        assert backends.cassandra_tls == CassandraTlsSettings(
            enabled=True, ca_file=Path("/etc/casque/tls/cassandra/ca.crt"),
            cert_file=Path("/etc/casque/tls/cassandra/tls.crt"), key_file=Path("/etc/casque/tls/cassandra/tls.key"),
            server_hostname="cassandra.shop.svc")
        assert backends.zookeeper_tls == ZooKeeperTlsSettings(enabled=True, ca_file=Path("/etc/casque/tls/zookeeper/ca.crt"))
        assert (sidecar.cassandra_tls_secret, sidecar.zookeeper_tls_secret) == ("cassandra-tls", "zookeeper-tls")
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in one(tools.render("casque", values), "Deployment")["spec"]["template"]["spec"]["volumes"]}
        for backend in ("cassandra", "zookeeper"):
            assert volumes[mounts[f"/etc/casque/tls/{backend}"]]["secret"]["secretName"] == f"{backend}-tls"
    else:
        # The release's own backends (the default): one Cassandra node in dc1, so one replica.
        assert backends.replication.datacenters == {"dc1": 1}
        (contact_point,) = backends.cassandra_contact_points
        assert contact_point.endswith("-casque-cassandra.casque.svc.cluster.local")
        assert sidecar.native_sidecar and sidecar.cpu_limit is None and sidecar.memory_limit == "256Mi"
        assert sidecar.image == "casque/sidecar:0.1.0" and sidecar.metrics_port == injection.DEFAULT_METRICS_PORT


def test_the_examples_are_accepted_by_the_api_server(
    tools: Tools, kube_namespace: str, casque_crds: None  # noqa: F811
) -> None:
    names = ["queue.yaml", "subscriber.yaml", "app-deployment.yaml", "app-manual-sidecar.yaml"]
    args = [a for name in names for a in ("-f", str(EXAMPLES / name))]
    out = tools.run(*tools.kubectl, "apply", "--dry-run=server", "-n", kube_namespace, *args).stdout
    for expected in ("queue.casque.io/orders", "queue.casque.io/orders-dlq", "subscriber.casque.io/billing",
                     "deployment.apps/billing-worker"):  # fmt: skip
        assert expected in out, out
    refused = tools.run(
        *tools.kubectl, "apply", "--dry-run=server", "-n", kube_namespace, "-f", "-", check=False,
        input=(EXAMPLES / "subscriber.yaml").read_text().replace("deadLetterQueue: orders-dlq", "deadLetterQueue: orders"),
    )  # fmt: skip
    assert refused.returncode != 0  # the CRD's rules are in force: a dead-letter queue is never its own queue


def test_the_rbac_allows_what_the_operator_does_and_nothing_else(
    tools: Tools, kube_namespace: str, other_namespace: str, casque_crds: None  # noqa: F811
) -> None:
    release = f"r{uuid.uuid4().hex[:6]}"
    show = ["--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml"]
    zookeeper_auth = {"zookeeper": {"auth": {"username": "casque", "password": "z" * 32}}}
    isolation = {"cassandra": {"isolation": "keyspace", "auth": {"username": "casque", "password": "c" * 32}}}
    # The sidecar's Secrets, copied from the release's namespace into the one it serves.
    copies = {"operator": {"watchNamespaces": [other_namespace]}, "sidecar": {"credentialsSecret": "casque-cassandra"},
              "zookeeper": {"tls": {"enabled": True, "secret": "zookeeper-tls"}}, **OWN_BACKENDS}
    watching = {"operator": {"watchNamespaces": [other_namespace]}}
    for values in (None, watching, zookeeper_auth, isolation, copies, OWN_BACKENDS):
        manifest = tools.template(kube_namespace, values, *show, release=release).stdout
        tools.run(*tools.kubectl, "apply", "-f", "-", input=manifest)
        try:
            account = f"{release}-casque"
            can = lambda verb, resource, on=None: tools.can_i(kube_namespace, account, verb, resource, on)  # noqa: E731
            served = other_namespace if values and "operator" in values else kube_namespace
            for verb in ("get", "list", "watch", "patch", "update"):
                assert can(verb, "queues.casque.io", served) and can(verb, "subscribers.casque.io", served)
            assert can("patch", "queues.casque.io/status", served) and can("update", "subscribers.casque.io/status", served)
            assert can("update", "queues.casque.io/finalizers", served)
            assert can("create", "events", served)
            assert can("list", "customresourcedefinitions.apiextensions.k8s.io") and can("watch", "namespaces")
            assert can("create", "leases.coordination.k8s.io")
            assert can("update", f"leases.coordination.k8s.io/{account}")
            # ... and no more.
            assert not can("update", "leases.coordination.k8s.io/someone-elses")
            assert not can("delete", "queues.casque.io", served) and not can("create", "subscribers.casque.io", served)
            if values is copies:
                for name in ("casque-cassandra", "zookeeper-tls"):
                    # Read where they are kept, by name, and nothing else there ...
                    assert can("get", f"secrets/{name}", kube_namespace)
                    for verb in ("patch", "update", "delete"):
                        assert not can(verb, f"secrets/{name}", kube_namespace)
                    # ... and written by name where the operator serves.
                    for verb in ("get", "patch", "delete"):
                        assert can(verb, f"secrets/{name}", served)
                assert not can("get", "secrets/unrelated", kube_namespace)
                assert not can("get", "secrets/unrelated", served) and not can("patch", "secrets/unrelated", served)
                for verb in ("list", "watch"):
                    assert not can(verb, "secrets", kube_namespace) and not can(verb, "secrets", served)
            # Secrets the operator writes: all but without the embedded backends' defaults.
            if values is not OWN_BACKENDS:
                for name in ("casque-zookeeper", "casque-cassandra-role"):
                    for verb in ("get", "patch", "delete"):
                        assert can(verb, f"secrets/{name}", served)
                assert can("create", "secrets", served)  # names are the admission policy's to check
                # ... and no other Secret: not read, changed or listed, here or anywhere.
                for verb in ("get", "patch", "update", "delete"):
                    assert not can(verb, "secrets/unrelated", served)
                for verb in ("get", "list", "watch"):
                    assert not can(verb, "secrets", served) and not can(verb, "secrets", "kube-system")
            else:
                assert not can("get", "secrets") and not can("create", "secrets")
            assert not can("create", "pods") and not can("list", "pods")
            assert not can("update", "customresourcedefinitions.apiextensions.k8s.io")
            assert not can("create", "mutatingwebhookconfigurations.admissionregistration.k8s.io")
            if values and "operator" in values:  # with watchNamespaces, nothing on casque's resources elsewhere
                assert not can("list", "queues.casque.io", kube_namespace)
        finally:
            tools.run(*tools.kubectl, "delete", "--wait=false", "-f", "-", input=manifest)


def test_the_operator_can_neither_read_nor_forge_a_secret_it_does_not_own(
    tools: Tools, kube_client: client.ApiClient, kube_namespace: str, other_namespace: str,
    casque_crds: None,  # noqa: F811
) -> None:
    """The operator's ServiceAccount, with namespace identities to write (cluster-wide), against
    a real API server: an unrelated Secret in a namespace it serves cannot be read, and a
    Secret of another name, or a service-account token Secret named like its own (which the
    token controller would fill with another account's token), cannot be created."""
    release = f"r{uuid.uuid4().hex[:6]}"
    values = {"zookeeper": {"auth": {"username": "casque", "password": "z" * 32}},
              "sidecar": {"credentialsSecret": "casque-cassandra"}, **OWN_BACKENDS}
    manifest = tools.template(kube_namespace, values, "--show-only", "templates/rbac.yaml", "--show-only",
                              "templates/serviceaccount.yaml", release=release).stdout
    account = f"system:serviceaccount:{kube_namespace}:{release}-casque"
    core = client.CoreV1Api(kube_client)
    core.create_namespaced_secret(other_namespace, {"metadata": {"name": "unrelated"}, "stringData": {"token": "x"}})
    owned = {"app.kubernetes.io/managed-by": "casque-operator"}

    def as_operator(*args: str, document: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        return tools.run(*tools.kubectl, *args, "-n", other_namespace, f"--as={account}", check=False,
                         input=json.dumps(document) if document else None)

    def secret(name: str, kind: str = "Opaque", labels: dict[str, str] = owned, **extra: Any) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "type": kind,
                "metadata": {"name": name, "labels": labels, **extra}, "stringData": {"password": "p"}}

    tools.run(*tools.kubectl, "apply", "-f", "-", input=manifest)
    try:
        read = as_operator("get", "secret", "unrelated", "-o", "json")
        assert read.returncode != 0 and "forbidden" in read.stderr.lower(), read.stdout
        assert "token" not in read.stdout
        listed = as_operator("get", "secrets")
        assert listed.returncode != 0 and "forbidden" in listed.stderr.lower()

        # The policy takes effect once the API server has loaded it: until a forged create is
        # refused, each one that got through is removed again.
        def forged_refused() -> bool:
            created = as_operator("create", "-f", "-", document=secret("forged"))
            if created.returncode == 0:
                core.delete_namespaced_secret("forged", other_namespace)
                return False
            assert "may only write its namespace Secrets" in created.stderr, created.stderr
            return True

        wait_for("the admission policy to refuse the operator's forged Secret", forged_refused)
        token = secret("casque-zookeeper", "kubernetes.io/service-account-token",
                       annotations={"kubernetes.io/service-account.name": "default"})
        refused = as_operator("create", "-f", "-", document=token)
        assert refused.returncode != 0 and "may only write its namespace Secrets" in refused.stderr
        unlabelled = as_operator("create", "-f", "-", document=secret("casque-zookeeper", labels={}))
        assert unlabelled.returncode != 0 and "may only write its namespace Secrets" in unlabelled.stderr
        # What the operator does write still works: its own Secret, created, read and patched.
        assert as_operator("create", "-f", "-", document=secret("casque-zookeeper")).returncode == 0
        assert as_operator("get", "secret", "casque-zookeeper").returncode == 0
        patched = as_operator("patch", "secret", "casque-zookeeper", "-p", '{"stringData": {"password": "q"}}')
        assert patched.returncode == 0, patched.stderr
        # The copy of the sidecar's credentials likewise, and likewise never as a token Secret.
        copy_token = secret("casque-cassandra", "kubernetes.io/service-account-token",
                            annotations={"kubernetes.io/service-account.name": "default"})
        refused = as_operator("create", "-f", "-", document=copy_token)
        assert refused.returncode != 0 and "may only write its namespace Secrets" in refused.stderr
        assert as_operator("create", "-f", "-", document=secret("casque-cassandra")).returncode == 0
    finally:
        tools.run(*tools.kubectl, "delete", "--wait=false", "-f", "-", input=manifest)


# --- the injection webhook, called by the API server -------------------------------------------


class WebhookOperator:
    """`casque operator run` with the webhook on 127.0.0.1, serving one namespace."""

    def __init__(self, cluster: KubeCluster, namespace: str, log: Path, *election: str) -> None:
        self.port, self.metrics_port = reserved_port(), reserved_port()
        cert, key = cluster.issue_serving_cert(f"webhook-{uuid.uuid4().hex[:6]}", ["127.0.0.1"])
        self.ca = str(cluster.ca_cert_path)
        self.source_namespace = f"{namespace}-home"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("CASQUE_")},
            "KUBECONFIG": str(cluster.kubeconfig_path),
            # Never contacted in these tests (no Queue is created): they only reach the sidecars.
            "CASQUE_CASSANDRA_CONTACT_POINTS": "cassandra-0.cassandra.example,cassandra-1.cassandra.example",
            "CASQUE_ZOOKEEPER_HOSTS": "zookeeper.example:2181",
            "CASQUE_KEYSPACE": "shop",
            "CASQUE_INJECTION_IMAGE": "registry.example.com/casque/sidecar:test",
            "CASQUE_INJECTION_CREDENTIALS_SECRET": "casque-cassandra",
            # Where the sidecar's Secrets are copied from: a namespace a test may make.
            "POD_NAMESPACE": self.source_namespace,
        }
        command = [
            sys.executable, "-m", "casque.cli", "operator", "run", "--namespace", namespace,
            *(election or ["--no-leader-election"]),
            "--webhook-address", "127.0.0.1", "--webhook-port", str(self.port),
            "--webhook-cert", str(cert), "--webhook-key", str(key), "--metrics-port", str(self.metrics_port),
        ]  # fmt: skip
        self.log_path = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    def serving(self) -> bool:
        assert self.process.poll() is None, f"the operator exited:\n{self.log_path.read_text()}"
        context = ssl.create_default_context(cafile=self.ca)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as raw:
                with context.wrap_socket(raw, server_hostname="127.0.0.1"):
                    return True
        except OSError:
            return False

    def review(self, pod: dict[str, Any]) -> dict[str, Any]:
        """An AdmissionReview sent straight to this replica, as the API server would."""
        body = {
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uuid.uuid4().hex, "operation": "CREATE", "object": pod},
        }  # fmt: skip
        request = urllib.request.Request(
            f"https://127.0.0.1:{self.port}/inject", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        context = ssl.create_default_context(cafile=self.ca)
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            answer: dict[str, Any] = json.loads(response.read())
        return answer

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def app_pod(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "app", "image": "example.com/app:1", "ports": [{"containerPort": 8080}]}]},
    }


ANNOTATED = {"casque.io/inject": "true", "casque.io/queue": "orders", "casque.io/subscriber": "billing"}


@pytest.fixture
def webhook(
    kube_cluster: KubeCluster,  # noqa: F811
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
    casque_crds: None,
    tmp_path: Path,
) -> Iterator[WebhookOperator]:
    """The operator's webhook registered with the API server, for this test's namespace only."""
    operator = WebhookOperator(kube_cluster, kube_namespace, tmp_path / "operator.log")
    admission = client.AdmissionregistrationV1Api(kube_client)
    name = f"casque-test-{kube_namespace}"
    try:
        wait_for("the webhook server to accept TLS connections", operator.serving)
        admission.create_mutating_webhook_configuration({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{
                "name": "sidecar-injector.casque.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                # Fail, not Ignore: a webhook that does not answer must fail the test.
                "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "clientConfig": {"url": f"https://127.0.0.1:{operator.port}/inject", "caBundle": kube_cluster.ca_bundle},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": kube_namespace}},
            }],
        })  # fmt: skip
        core = client.CoreV1Api(kube_client)

        # The API server picks up a new webhook configuration asynchronously: create
        # throwaway annotated pods until one comes back with the sidecar.
        def active() -> bool:
            probe = core.create_namespaced_pod(kube_namespace, app_pod(f"probe-{uuid.uuid4().hex[:6]}", ANNOTATED))
            core.delete_namespaced_pod(probe.metadata.name, kube_namespace, grace_period_seconds=0)
            return bool(probe.spec.init_containers)

        wait_for("the API server to call the webhook", active)
        yield operator
    finally:
        try:
            admission.delete_mutating_webhook_configuration(name)
        except ApiException as error:
            if error.status != 404:
                raise
        operator.stop()
        print(f"--- operator log\n{operator.log_path.read_text(errors='replace')[-4000:]}")


def stored_pod(kube_client: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:  # noqa: F811
    response = client.CoreV1Api(kube_client).read_namespaced_pod(name, namespace, _preload_content=False)
    pod: dict[str, Any] = json.loads(response.data)
    return pod


def test_the_api_server_has_the_webhook_add_the_sidecar_to_annotated_pods(
    webhook: WebhookOperator, kube_client: client.ApiClient, kube_namespace: str  # noqa: F811
) -> None:
    core = client.CoreV1Api(kube_client)
    core.create_namespaced_pod(kube_namespace, app_pod("billing", ANNOTATED))
    pod = stored_pod(kube_client, kube_namespace, "billing")
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["name"] == injection.SIDECAR_NAME and sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "registry.example.com/casque/sidecar:test" and sidecar["args"] == ["sidecar"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in sidecar["env"]}
    assert env["CASQUE_SIDECAR_QUEUE"] == "orders" and env["CASQUE_SIDECAR_SUBSCRIBERS"] == "billing"
    assert env["CASQUE_CASSANDRA_CONTACT_POINTS"] == "cassandra-0.cassandra.example,cassandra-1.cassandra.example"
    assert env["CASQUE_ZOOKEEPER_HOSTS"] == "zookeeper.example:2181" and env["CASQUE_KEYSPACE"] == "shop"
    assert env["CASQUE_CASSANDRA_PASSWORD"]["secretKeyRef"]["name"] == "casque-cassandra"
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    (app,) = pod["spec"]["containers"]
    assert {e["name"]: e["value"] for e in app["env"]} == {
        "CASQUE_SIDECAR_URL": "http://127.0.0.1:8717", "CASQUE_SIDECAR_QUEUE": "orders",
        "CASQUE_SIDECAR_SUBSCRIBERS": "billing",
    }  # fmt: skip
    assert {"name": injection.TMP_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}} in pod["spec"]["volumes"]
    assert pod["metadata"]["labels"][injection.SIDECAR_LABEL] == injection.SIDECAR_LABEL_VALUE
    assert 'casque_operator_admission_reviews_total{outcome="injected"}' in webhook.metrics()


def test_an_injected_pods_namespace_gets_the_sidecars_secret_without_waiting_for_it(
    webhook: WebhookOperator, kube_client: client.ApiClient, kube_namespace: str  # noqa: F811
) -> None:
    core = client.CoreV1Api(kube_client)
    home = webhook.source_namespace
    core.create_namespace({"metadata": {"name": home}})
    try:
        core.create_namespaced_secret(home, {"metadata": {"name": "casque-cassandra"},
                                             "stringData": {"username": "sidecars", "password": "installation"}})
        # No Queue in the namespace: only the webhook's pass can make the copy.
        core.create_namespaced_pod(kube_namespace, app_pod("billing", ANNOTATED))

        def copied() -> client.V1Secret | None:
            try:
                return core.read_namespaced_secret("casque-cassandra", kube_namespace)
            except ApiException as error:
                if error.status == 404:
                    return None
                raise

        copy = wait_for("the webhook to copy the sidecar's Secret into the pod's namespace", copied)
        assert copy.data == core.read_namespaced_secret("casque-cassandra", home).data
        assert copy.metadata.labels == {"app.kubernetes.io/managed-by": "casque-operator"}
    finally:
        core.delete_namespace(home)


def test_the_api_server_stores_other_pods_as_they_were(
    webhook: WebhookOperator, kube_client: client.ApiClient, kube_namespace: str  # noqa: F811
) -> None:
    core = client.CoreV1Api(kube_client)
    for name, pod_annotations in [("plain", None), ("opted-out", {"casque.io/inject": "false", "casque.io/queue": "orders"})]:
        sent = app_pod(name, pod_annotations)
        core.create_namespaced_pod(kube_namespace, sent)
        pod = stored_pod(kube_client, kube_namespace, name)
        assert "initContainers" not in pod["spec"]
        assert [c["name"] for c in pod["spec"]["containers"]] == ["app"]
        assert "env" not in pod["spec"]["containers"][0]
        assert not any(v["name"] == injection.TMP_VOLUME for v in pod["spec"].get("volumes", []))
    # A pod that has the sidecar already (written by hand) is not given a second one.
    manual = yaml.safe_load((EXAMPLES / "app-manual-sidecar.yaml").read_text())["spec"]["template"]
    manual["metadata"].update(name="manual", annotations=ANNOTATED)
    core.create_namespaced_pod(kube_namespace, {"apiVersion": "v1", "kind": "Pod", **manual})
    pod = stored_pod(kube_client, kube_namespace, "manual")
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [injection.SIDECAR_NAME]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["worker"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == [injection.TMP_VOLUME]


def test_the_api_server_refuses_a_pod_whose_annotations_cannot_be_honoured(
    webhook: WebhookOperator, kube_client: client.ApiClient, kube_namespace: str  # noqa: F811
) -> None:
    core = client.CoreV1Api(kube_client)
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(kube_namespace, app_pod("clash", {**ANNOTATED, "casque.io/port": "8080"}))
    assert refused.value.status == 422
    message = json.loads(refused.value.body)["message"]
    assert "sidecar-injector.casque.io" in message and "container 'app' uses port 8080" in message
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("clash", kube_namespace)
    assert missing.value.status == 404


def test_every_replica_answers_the_webhook_leader_or_standby(
    kube_cluster: KubeCluster,  # noqa: F811
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
    casque_crds: None,
    tmp_path: Path,
) -> None:
    """The webhook Service spreads requests over all replicas, so a standby must answer too."""
    election = ["--lease-namespace", kube_namespace, "--lease-name", "casque-test"]
    replicas = [WebhookOperator(kube_cluster, kube_namespace, tmp_path / f"operator-{i}.log", *election) for i in range(2)]
    try:
        for replica in replicas:
            wait_for("a replica's webhook to accept TLS connections", replica.serving)
        coordination = client.CoordinationV1Api(kube_client)

        def holder() -> str | None:
            try:
                return str(coordination.read_namespaced_lease("casque-test", kube_namespace).spec.holder_identity or "")
            except ApiException as error:
                if error.status == 404:
                    return None
                raise

        wait_for("one replica to hold the Lease", holder)  # the other stands by
        for replica in replicas:
            answer = replica.review(app_pod("billing", ANNOTATED))["response"]
            assert answer["allowed"] is True and answer["patchType"] == "JSONPatch"
            plain = replica.review(app_pod("plain"))["response"]
            assert plain["allowed"] is True and "patch" not in plain
        # Each replica says on its metrics port whether it leads: the Lease's holder only.
        leading = wait_for("the leader's gauge", lambda: [r for r in replicas if leader_gauge(r) == 1.0] or None)
        assert len(leading) == 1 and [leader_gauge(r) for r in replicas if r not in leading] == [0.0]
    finally:
        for replica in replicas:
            replica.stop()


def test_the_dashboard_and_alert_rules_render_when_enabled(tools: Tools, kube_namespace: str) -> None:  # noqa: F811
    assert not of_kind(tools.render(kube_namespace), "PrometheusRule")  # both are off by default
    documents = tools.render(kube_namespace, {"metrics": {
        "dashboards": {"enabled": True, "namespace": "monitoring"},
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}, "lagMessages": 500, "for": "5m"},
    }})
    dashboards = next(d for d in of_kind(documents, "ConfigMap") if d["metadata"]["name"].endswith("-dashboards"))
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboards["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(dashboards["data"]["casque.json"])
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Lag (messages)", "Oldest pending message age", "Dead-lettered (per 5 minutes)", "Publish rate",
            "Receive and ack rates"} <= titles
    rule = one(documents, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(alerts) == {"CasqueSubscriberLagHigh", "CasqueSubscriberOldestMessageOld", "CasqueMessagesDeadLettered",
                           "CasqueSubscriberStalled", "CasqueSubscriberLagGrowingWithoutConsumers",
                           "CasqueSubscriberLagGrowingAtMaxConsumers", "CasqueOperatorNoLeader", "CasqueOperatorReconcileErrors", "CasqueInjectionWebhookFailing",
                           "CasqueSidecarErrorsHigh", "CasqueSidecarProtocolRefused", "CasqueSidecarNewerFormat",
                           "CasqueNamespaceOverStoredBytesQuota", "CasqueNamespaceOverWriteRateQuota"}
    # The stall alert reads the sidecars' gauge (scraped through the PodMonitor), per subscriber over its pods.
    stalled = alerts["CasqueSubscriberStalled"]
    assert stalled["expr"] == "max by (namespace, queue, subscriber) (casque_sidecar_stalled_shards) > 0"
    assert stalled["for"] == "2m" and "casque describe subscriber" in stalled["annotations"]["description"]
    assert "{{ $labels.subscriber }}" in stalled["annotations"]["summary"]
    assert alerts["CasqueSubscriberLagHigh"]["expr"].endswith("> 500") and alerts["CasqueSubscriberLagHigh"]["for"] == "5m"
    # A sidecar that publishes nothing because the installation's protocol is above its own.
    assert alerts["CasqueSidecarProtocolRefused"]["expr"] == "max by (namespace, pod) (casque_sidecar_protocol_refused) > 0"
    # ... and one that meets records of a later format (casque.formats) and leaves them unread.
    assert alerts["CasqueSidecarNewerFormat"]["expr"] == (
        "max by (namespace, pod) (increase(casque_sidecar_newer_format_refusals_total[5m])) > 0")
    # At the autoscaler's maximum: its HPA (KEDA's too) read from kube-state-metrics by the subscriber's name.
    at_max = alerts["CasqueSubscriberLagGrowingAtMaxConsumers"]
    assert "kube_horizontalpodautoscaler_spec_max_replicas" in at_max["expr"] and "keda-hpa-" in at_max["expr"]
    assert "falls behind at its autoscaler's maximum" in at_max["annotations"]["summary"]
    assert "Autoscaling: consumers, lag per consumer and the autoscaler's maximum" in titles
    # Prometheus fills in the alert's labels: the template must leave its {{ }} to it.
    assert "{{ $labels.subscriber }}" in alerts["CasqueSubscriberLagHigh"]["annotations"]["summary"]
    refused = tools.template(kube_namespace, {"metrics": {"prometheusRule": {"for": "ten minutes"}}}, check=False)
    assert refused.returncode != 0 and SCHEMA_ERROR in refused.stderr


def leader_gauge(replica: WebhookOperator) -> float | None:
    for family in text_string_to_metric_families(replica.metrics()):
        for sample in family.samples:
            if sample.name == "casque_operator_leader":
                return float(sample.value)
    return None


# Labels a scrape adds to every series (the ServiceMonitor's and PodMonitor's targets).
TARGET_LABELS = {"namespace", "pod", "container", "service", "job", "instance", "endpoint"}
SELECTOR = re.compile(r"\b(casque_[a-z_]+)\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")


def exported() -> dict[str, MetricWrapperBase]:
    """Every series name the operator and a sidecar export, to the metric that exports it."""
    metrics: list[MetricWrapperBase] = [m for m in vars(operator_metrics).values() if isinstance(m, MetricWrapperBase)]
    metrics += operator_metrics.SUBSCRIBER_GAUGES.values()
    metrics += [m for m in vars(SidecarMetrics()).values() if isinstance(m, MetricWrapperBase)]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix: metric for metric in metrics for family in metric.describe()
            for suffix in suffixes[family.type]}


def test_every_metric_an_alert_names_is_one_casque_exports_with_those_labels(
    tools: Tools, kube_namespace: str  # noqa: F811
) -> None:
    """The rendered rules, as Prometheus gets them, against the operator's and the sidecar's
    metric definitions: a renamed metric or label would leave an alert that never fires."""
    documents = tools.render(kube_namespace, {"metrics": {"prometheusRule": {"enabled": True}}})
    rules = [r for group in one(documents, "PrometheusRule")["spec"]["groups"] for r in group["rules"]]
    known = exported()
    assert {"casque_operator_reconciles_total", "casque_operator_leader",
            "casque_sidecar_requests_total"} <= set(known)  # the definitions were found
    named: set[str] = set()
    for rule in rules:
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        selectors = SELECTOR.findall(rule["expr"])
        assert selectors, rule["alert"]
        for name, matchers in selectors:
            assert name in known, f"{rule['alert']} names {name}, which casque does not export"
            named.add(name)
            labels = {label for label, _, _ in MATCHER.findall(matchers)} - TARGET_LABELS
            # prometheus_client keeps a metric's label names only in this attribute.
            assert labels <= set(known[name]._labelnames), f"{rule['alert']} selects {name} by {sorted(labels)}"
    assert {"casque_operator_reconcile_errors_total", "casque_operator_leader", "casque_operator_admission_reviews_total",
            "casque_sidecar_requests_total", "casque_subscriber_consumers", "casque_subscriber_lag_messages"} <= named
    # The one label value an alert picks out of the operator's own: the webhook's failures.
    assert 'outcome="error"' in next(r["expr"] for r in rules if r["alert"] == "CasqueInjectionWebhookFailing")
    assert "error" in get_args(operator_metrics.AdmissionOutcome)
    # Its own namespace, where the chart's ServiceMonitor finds the operator.
    no_leader = next(r["expr"] for r in rules if r["alert"] == "CasqueOperatorNoLeader")
    assert no_leader == f'absent(casque_operator_leader{{namespace="{kube_namespace}"}} == 1)'
    # Without the operator's metrics endpoint the operator's alerts could only ever fire.
    refused = tools.template(kube_namespace, {"metrics": {"enabled": False, "prometheusRule": {"enabled": True}}},
                             check=False)
    assert refused.returncode != 0 and "metrics.prometheusRule needs metrics.enabled" in refused.stderr
