"""A Kubernetes API client for what kopf does not do for us: the Lease and the watch-health LIST.

Credentials are found the way kopf finds its own: the pod's service account inside a
cluster, otherwise $KUBECONFIG or ~/.kube/config.
"""

from __future__ import annotations

import os

from kubernetes import client, config


def api_client() -> client.ApiClient:
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return client.ApiClient(configuration)
    api: client.ApiClient = config.new_client_from_config()  # type: ignore[no-untyped-call]
    return api
