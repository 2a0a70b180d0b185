"""The local kube-apiserver harness serves a real Kubernetes API.

Covers what casque's operator tests rely on: namespaces, CRDs with structural schemas and
CEL validation rules, kubectl and helm talking to the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from casque.devstack.kube import KubeCluster, start_kube_api
from tests.fixtures.kube import kube_tool, require_kube_tools

GROUP = "harness.casque.io"
VERSION = "v1alpha1"
PLURAL = "widgets"
CRD_NAME = f"{PLURAL}.{GROUP}"
CEL_MESSAGE = "spec.replicas must be at least 1"


def wait_for(what: str, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``condition`` until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def error_body(err: ApiException) -> dict[str, Any]:
    """The ``Status`` object of a refused request."""
    assert err.body is not None
    return cast(dict[str, Any], json.loads(err.body))


def widget_crd() -> Any:  # the client accepts plain dicts wherever it takes a model
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": "widget",
                "kind": "Widget",
                "listKind": "WidgetList",
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["replicas"],
                                    "properties": {
                                        "replicas": {"type": "integer", "format": "int32"},
                                        "topic": {"type": "string", "maxLength": 63},
                                    },
                                    "x-kubernetes-validations": [
                                        {"rule": "self.replicas >= 1", "message": CEL_MESSAGE}
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def widget(name: str, replicas: int) -> Any:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "topic": "orders"},
    }


@pytest.fixture(scope="module")
def established_crd(kube_client: client.ApiClient) -> Iterator[str]:  # noqa: F811
    ext = client.ApiextensionsV1Api(kube_client)
    ext.create_custom_resource_definition(widget_crd())

    def established() -> bool:
        status = ext.read_custom_resource_definition(CRD_NAME).status
        conditions = (status.conditions if status else None) or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_for(f"CRD {CRD_NAME} to be Established", established)
    try:
        yield CRD_NAME
    finally:
        ext.delete_custom_resource_definition(CRD_NAME)

        def gone() -> bool:
            try:
                ext.read_custom_resource_definition(CRD_NAME)
            except ApiException as err:
                if err.status == 404:
                    return True
                raise
            return False

        wait_for(f"CRD {CRD_NAME} to be deleted", gone)


def test_namespace_is_created_and_active(
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    ns = client.CoreV1Api(kube_client).read_namespace(kube_namespace)
    assert ns.metadata is not None and ns.status is not None
    assert ns.metadata.name == kube_namespace
    assert ns.status.phase == "Active"
    assert (ns.metadata.labels or {}).get("casque.io/test") == "true"


def test_crd_structural_schema_and_cel_rule(
    kube_client: client.ApiClient,  # noqa: F811
    kube_namespace: str,  # noqa: F811
    established_crd: str,
) -> None:
    api = client.CustomObjectsApi(kube_client)

    created = cast(
        dict[str, Any],
        api.create_namespaced_custom_object(
            GROUP, VERSION, kube_namespace, PLURAL, widget("good", replicas=3)
        ),
    )
    assert created["spec"] == {"replicas": 3, "topic": "orders"}
    fetched = cast(
        dict[str, Any],
        api.get_namespaced_custom_object(GROUP, VERSION, kube_namespace, PLURAL, "good"),
    )
    assert fetched["metadata"]["uid"] == created["metadata"]["uid"]

    with pytest.raises(ApiException) as refused:
        api.create_namespaced_custom_object(
            GROUP, VERSION, kube_namespace, PLURAL, widget("bad", replicas=0)
        )
    assert refused.value.status == 422
    status = error_body(refused.value)
    assert status["reason"] == "Invalid"
    assert CEL_MESSAGE in status["message"]
    causes = status["details"]["causes"]
    assert any(CEL_MESSAGE in c.get("message", "") for c in causes), causes

    # The structural schema is enforced too: a missing required field is refused.
    missing = widget("incomplete", replicas=1)
    del missing["spec"]["replicas"]
    with pytest.raises(ApiException) as incomplete:
        api.create_namespaced_custom_object(GROUP, VERSION, kube_namespace, PLURAL, missing)
    assert incomplete.value.status == 422
    assert "spec.replicas: Required value" in error_body(incomplete.value)["message"]

    listed = cast(
        dict[str, Any], api.list_namespaced_custom_object(GROUP, VERSION, kube_namespace, PLURAL)
    )
    assert [item["metadata"]["name"] for item in listed["items"]] == ["good"]


def test_rbac_is_enforced_for_unauthenticated_requests(
    kube_cluster: KubeCluster,  # noqa: F811
) -> None:
    config = client.Configuration()
    config.host = kube_cluster.server_url
    config.ssl_ca_cert = str(kube_cluster.ca_cert_path)
    with client.ApiClient(config) as anonymous:
        with pytest.raises(ApiException) as denied:
            client.CoreV1Api(anonymous).list_namespace()
    assert denied.value.status in (401, 403)


def test_kubectl_get_namespaces(
    kube_cluster: KubeCluster,  # noqa: F811
    kube_namespace: str,  # noqa: F811
) -> None:
    kubectl = kube_tool("kubectl")
    base = [str(kubectl), "--kubeconfig", str(kube_cluster.kubeconfig_path)]

    out = subprocess.run(
        [*base, "get", "namespaces"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:]}
    assert out.splitlines()[0].split()[:2] == ["NAME", "STATUS"]
    assert rows[kube_namespace] == "Active"
    assert rows["default"] == "Active"

    version = json.loads(
        subprocess.run(
            [*base, "version", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    assert version["clientVersion"]["gitVersion"] == version["serverVersion"]["gitVersion"]


def test_helm_runs_against_the_cluster(
    kube_cluster: KubeCluster,  # noqa: F811
    kube_namespace: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    helm = kube_tool("helm")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(tmp_path / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "config"),
        "HELM_DATA_HOME": str(tmp_path / "data"),
        "KUBECONFIG": str(kube_cluster.kubeconfig_path),
    }
    version = subprocess.run(
        [str(helm), "version", "--short"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    ).stdout.strip()
    assert version.startswith("v3.")

    listed = subprocess.run(
        [str(helm), "list", "--namespace", kube_namespace, "--output", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    ).stdout
    assert json.loads(listed) == []


def test_cluster_context_manager_stops_both_processes(tmp_path: Path) -> None:
    require_kube_tools("etcd", "kube-apiserver")
    with start_kube_api(tmp_path / "kube") as cluster:
        assert cluster.running()
        assert cluster.kubeconfig_path.is_file()
        assert cluster.server_url.startswith("https://127.0.0.1:")
    assert not cluster.running()
