"""The operator's External Metrics API (casque.operator.metrics_api) behind a real
kube-apiserver's aggregation layer: an APIService of `external.metrics.k8s.io/v1beta1` on
a Service whose endpoint is `casque operator run --metrics-api-port`, on the host's address.

A HorizontalPodAutoscaler's controller reads it the way these tests do: through the API
server, as a user RBAC allows. The server itself takes only the API server's front proxy,
and asks the API server (a SubjectAccessReview) whether the user it names may read the
namespace's metric.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from casque.devstack.kube import KubeCluster, free_port
from casque.devstack.node import host_address
from casque.devstack.pki import issue_cert
from casque.operator.external_metrics import GROUP, GROUP_VERSION, VERSION
from casque.operator.resources import GROUP as CASQUE_GROUP, SUBSCRIBERS, VERSION as CASQUE_VERSION
from tests.fixtures.waiting import wait_for
from tests.integration.test_operator import casque_crds as casque_crds  # the fixture

pytestmark = pytest.mark.integration

APISERVICE = f"{VERSION}.{GROUP}"
LAG = "casque-subscriber-lag-messages"


@dataclass(frozen=True)
class ServedApi:
    """The External Metrics API as registered: its server's own URL and the cluster's."""

    url: str  # the server itself, on the host's address
    cluster: KubeCluster
    renew_certificate: Callable[[], None]  # a new serving certificate in the files it was started with


def available(api: client.ApiregistrationV1Api, operator: subprocess.Popen[bytes], log: Path) -> bool:
    assert operator.poll() is None, f"the operator exited:\n{log.read_text()}"
    conditions = api.read_api_service(APISERVICE).status.conditions or []
    return any(c.type == "Available" and c.status == "True" for c in conditions)


def serving_certificate(cluster: KubeCluster, namespace: str, address: str, pki: Path) -> tuple[Path, Path]:
    # The aggregation layer checks the server's certificate for the Service's name.
    return issue_cert(pki, cluster.ca_cert_path, cluster.ca_key_path, "casque-metrics",
                      [f"casque-metrics.{namespace}.svc", address])


def operator_serving_the_metrics_api(cluster: KubeCluster, namespace: str, address: str, port: int, pki: Path,
                                     log: Path) -> subprocess.Popen[bytes]:
    """`casque operator run` with the External Metrics API on the host's address. Its kopf
    serves a namespace with no Queue in it, so the backends it is pointed at are never called."""
    certfile, keyfile = serving_certificate(cluster, namespace, address, pki)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CASQUE_")},
        "KUBECONFIG": str(cluster.kubeconfig_path),
        "CASQUE_CASSANDRA_CONTACT_POINTS": "cassandra.example", "CASQUE_ZOOKEEPER_HOSTS": "zookeeper.example:2181",
        "CASQUE_OPERATOR_METRICS_API_CERT": str(certfile), "CASQUE_OPERATOR_METRICS_API_KEY": str(keyfile),
    }
    command = [sys.executable, "-m", "casque.cli", "operator", "run", "--namespace", namespace,
               "--no-leader-election", "--webhook-address", address, "--metrics-api-port", str(port)]
    with open(log, "ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def metrics_api(kube_cluster: KubeCluster, kube_client: client.ApiClient, casque_crds: None,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApi]:
    """The operator serving the API, and the Service, Endpoints and APIService that make the
    API server proxy `external.metrics.k8s.io` to it."""
    address, port = host_address(), free_port()
    system = f"casque-{uuid.uuid4().hex[:8]}"
    workdir = tmp_path_factory.mktemp("metrics-api")
    core, registration = client.CoreV1Api(kube_client), client.ApiregistrationV1Api(kube_client)
    core.create_namespace({"metadata": {"name": system}})
    log = workdir / "operator.log"
    operator = operator_serving_the_metrics_api(kube_cluster, system, address, port, workdir, log)
    try:
        core.create_namespaced_service(system, {"metadata": {"name": "casque-metrics"},
                                                "spec": {"ports": [{"port": 443, "targetPort": port}]}})
        core.create_namespaced_endpoints(system, {"metadata": {"name": "casque-metrics"}, "subsets": [
            {"addresses": [{"ip": address}], "ports": [{"port": port}]}]})
        registration.create_api_service({
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
            "spec": {"group": GROUP, "version": VERSION, "caBundle": kube_cluster.ca_bundle,
                     "service": {"name": "casque-metrics", "namespace": system, "port": 443},
                     "groupPriorityMinimum": 100, "versionPriority": 100}})
        wait_for(f"the APIService {APISERVICE} Available", lambda: available(registration, operator, log),
                 timeout=120)
        yield ServedApi(f"https://{address}:{port}", kube_cluster,
                        lambda: serving_certificate(kube_cluster, system, address, workdir) and None)
    finally:
        operator.send_signal(signal.SIGTERM)
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
        try:
            registration.delete_api_service(APISERVICE)
        finally:
            core.delete_namespace(system)


def call(url: str, context: ssl.SSLContext, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def through_the_api_server(served: ServedApi, path: str, as_user: str | None = None) -> tuple[int, dict[str, Any]]:
    """GET `path` of the API server as its admin, or as `as_user` (impersonated)."""
    context = ssl.create_default_context(cafile=str(served.cluster.ca_cert_path))
    headers = {"Authorization": f"Bearer {served.cluster.token}"}
    if as_user:
        headers["Impersonate-User"] = as_user
    return call(served.cluster.server_url + path, context, headers)


def front_proxy_files(served: ServedApi) -> tuple[Path, Path]:
    """The API server's front-proxy client certificate (casque.devstack.kube)."""
    pki = served.cluster.workdir / "pki" / "front-proxy"
    return pki / "front-proxy-client.crt", pki / "front-proxy-client.key"


def directly(served: ServedApi, path: str, user: str | None, client_cert: tuple[Path, Path] | None
             ) -> tuple[int, dict[str, Any]]:
    """GET `path` of the metrics server itself, as the front proxy would (or without its certificate)."""
    context = ssl.create_default_context(cafile=str(served.cluster.ca_cert_path))
    if client_cert:
        context.load_cert_chain(*client_cert)
    return call(served.url + path, context, {"X-Remote-User": user} if user else {})


def subscriber_with_figures(kube_client: client.ApiClient, namespace: str, name: str, lag: int) -> None:
    """A Subscriber whose status holds the figures a refresh writes."""
    custom = client.CustomObjectsApi(kube_client)
    custom.create_namespaced_custom_object(CASQUE_GROUP, CASQUE_VERSION, namespace, SUBSCRIBERS, {
        "apiVersion": f"{CASQUE_GROUP}/{CASQUE_VERSION}", "kind": "Subscriber", "metadata": {"name": name},
        "spec": {"queue": "orders"}})
    custom.patch_namespaced_custom_object_status(CASQUE_GROUP, CASQUE_VERSION, namespace, SUBSCRIBERS, name, {
        "status": {"queue": "orders", "lagMessages": lag, "inFlight": 2, "oldestPendingTime": None}})


@pytest.fixture
def two_namespaces(kube_client: client.ApiClient) -> Iterator[tuple[str, str]]:
    core = client.CoreV1Api(kube_client)
    names = (f"shop-a-{uuid.uuid4().hex[:8]}", f"shop-b-{uuid.uuid4().hex[:8]}")
    for name in names:
        core.create_namespace({"metadata": {"name": name}})
    try:
        yield names
    finally:
        for name in names:
            core.delete_namespace(name)


def values(answer: dict[str, Any]) -> dict[str, str]:
    return {item["metricLabels"]["subscriber"]: item["value"] for item in answer["items"]}


def test_a_subscribers_lag_is_read_through_the_api_server_by_the_selector_an_autoscaler_names(
    metrics_api: ServedApi, kube_client: client.ApiClient, two_namespaces: tuple[str, str],
) -> None:
    shop, _ = two_namespaces
    subscriber_with_figures(kube_client, shop, "billing", 1200)
    subscriber_with_figures(kube_client, shop, "audit", 7)
    base = f"/apis/{GROUP_VERSION}/namespaces/{shop}"

    code, discovery = through_the_api_server(metrics_api, f"/apis/{GROUP_VERSION}")
    assert code == 200 and LAG in {r["name"] for r in discovery["resources"]}, discovery
    code, answer = through_the_api_server(metrics_api, f"{base}/{LAG}?labelSelector=" +
                                          urllib.parse.quote("subscriber=billing"))
    assert code == 200, answer
    assert values(answer) == {"billing": "1200"}
    assert answer["items"][0]["metricLabels"] == {"queue": "orders", "subscriber": "billing"}
    code, answer = through_the_api_server(metrics_api, f"{base}/casque-subscriber-in-flight")
    assert code == 200 and values(answer) == {"audit": "2", "billing": "2"}, answer

    # What a client gets wrong is answered as the API server answers it.
    code, answer = through_the_api_server(metrics_api, f"{base}/{LAG}?labelSelector=" +
                                          urllib.parse.quote("subscriber in billing"))
    assert code == 400 and answer["kind"] == "Status" and "cannot parse" in answer["message"], answer
    code, answer = through_the_api_server(metrics_api, f"{base}/casque-bogus")
    assert code == 404 and LAG in answer["message"], answer


def test_a_user_reads_only_the_namespaces_rbac_allows_and_only_the_front_proxy_may_call_the_server(
    metrics_api: ServedApi, kube_client: client.ApiClient, two_namespaces: tuple[str, str],
) -> None:
    allowed, other = two_namespaces
    for namespace in two_namespaces:
        subscriber_with_figures(kube_client, namespace, "billing", 5)
    rbac = client.RbacAuthorizationV1Api(kube_client)
    rbac.create_namespaced_role(allowed, {"metadata": {"name": "read-external-metrics"}, "rules": [
        # A metric's values are a collection of the namespace: the API server asks for list.
        {"apiGroups": [GROUP], "resources": ["*"], "verbs": ["list"]}]})
    rbac.create_namespaced_role_binding(allowed, {
        "metadata": {"name": "alice-reads-external-metrics"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-external-metrics"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}]})
    user = "alice"

    def path(namespace: str) -> str:
        return f"/apis/{GROUP_VERSION}/namespaces/{namespace}/{LAG}"

    # The RoleBinding is read from the API server's cache: wait until it applies.
    wait_for("alice's Role to apply", lambda: through_the_api_server(metrics_api, path(allowed), user)[0] == 200)
    code, answer = through_the_api_server(metrics_api, path(allowed), user)
    assert values(answer) == {"billing": "5"}
    code, answer = through_the_api_server(metrics_api, path(other), user)
    assert code == 403, answer

    # The server's own check, reached without the API server's: the front proxy naming a user
    # the namespace does not allow is refused by the SubjectAccessReview.
    proxy = front_proxy_files(metrics_api)
    assert directly(metrics_api, path(allowed), user, proxy)[0] == 200
    code, answer = directly(metrics_api, path(other), user, proxy)
    assert code == 403 and answer["reason"] == "Forbidden" and user in answer["message"], answer
    # Without the front proxy's certificate, nobody: not even with a user's name in the header.
    code, answer = directly(metrics_api, path(allowed), user, None)
    assert code == 401 and answer["kind"] == "Status", answer
    # A certificate of another CA does not make it through TLS.
    stranger = issue_cert(metrics_api.cluster.workdir / "pki", metrics_api.cluster.ca_cert_path,
                          metrics_api.cluster.ca_key_path, "stranger", client=True)
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        directly(metrics_api, path(allowed), user, stranger)


def served_certificate(served: ServedApi) -> str:
    host, port = urllib.parse.urlsplit(served.url).netloc.rsplit(":", 1)
    return ssl.get_server_certificate((host, int(port)), timeout=10)


def test_a_renewed_serving_certificate_is_served_without_a_restart(
    metrics_api: ServedApi, kube_client: client.ApiClient, two_namespaces: tuple[str, str],
) -> None:
    """As cert-manager renews the Secret the operator's pods mount: the new certificate is
    served from then on, and the API server still reaches the metrics through it."""
    shop, _ = two_namespaces
    subscriber_with_figures(kube_client, shop, "billing", 11)
    before = served_certificate(metrics_api)
    metrics_api.renew_certificate()
    wait_for("the renewed certificate served", lambda: served_certificate(metrics_api) != before, timeout=120)
    code, answer = through_the_api_server(metrics_api, f"/apis/{GROUP_VERSION}/namespaces/{shop}/{LAG}")
    assert code == 200 and values(answer) == {"billing": "11"}, answer
