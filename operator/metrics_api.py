"""The operator's External Metrics API server: an extension API server behind the Kubernetes
aggregation layer (an APIService of `external.metrics.k8s.io/v1beta1`), answering with
casque.operator.external_metrics.

Who asks is the API server, proxying a user's request: it presents its front-proxy client
certificate and names the user and groups in headers, as kube-system's
extension-apiserver-authentication ConfigMap describes. A request without that
certificate is refused (401); the named user is then authorized with a SubjectAccessReview
for `list` on the metric in the namespace (403 if denied; the API server authorizes the
same verb, as a metric's values are a collection of the namespace), so RBAC decides who reads which
namespace's lag, as for any resource.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from casque.operator import external_metrics, resources
from casque.operator.external_metrics import GROUP, GROUP_VERSION, VERSION, BadSelector

log = logging.getLogger(__name__)

AUTHENTICATION_CONFIGMAP = ("kube-system", "extension-apiserver-authentication")
PREFIX = f"/apis/{GROUP_VERSION}"


@dataclass(frozen=True)
class MetricsApiOptions:
    """Where the External Metrics API listens. The aggregation layer only calls HTTPS."""

    port: int
    certfile: Path
    keyfile: Path
    address: str = "0.0.0.0"


@dataclass(frozen=True)
class FrontProxy:
    """How the API server authenticates itself and names the user it proxies for."""

    client_ca: str  # PEM
    allowed_names: frozenset[str]  # empty: any certificate the CA signed
    username_headers: tuple[str, ...]
    group_headers: tuple[str, ...]

    @classmethod
    def from_configmap(cls, data: Mapping[str, str]) -> FrontProxy:
        """From extension-apiserver-authentication's data (its lists are JSON arrays)."""
        ca = data.get("requestheader-client-ca-file")
        if not ca:
            raise ValueError("the API server publishes no requestheader client CA: its aggregation layer is off")

        def names(key: str) -> tuple[str, ...]:
            return tuple(json.loads(data.get(key) or "[]"))
        return cls(client_ca=ca, allowed_names=frozenset(names("requestheader-allowed-names")),
                   username_headers=names("requestheader-username-headers"),
                   group_headers=names("requestheader-group-headers"))


@dataclass(frozen=True)
class Requester:
    user: str
    groups: tuple[str, ...]


def requester(proxy: FrontProxy, peer_common_name: str | None, headers: Mapping[str, str],
              header_values: Callable[[str], Sequence[str]]) -> Requester | None:
    """The user a request is made for, if it came from the front proxy (a certificate of its
    CA, verified by TLS, with an allowed name) and names one; else None."""
    if peer_common_name is None or (proxy.allowed_names and peer_common_name not in proxy.allowed_names):
        return None
    user = next((headers[h] for h in proxy.username_headers if headers.get(h)), None)
    if not user:
        return None
    groups = tuple(group for header in proxy.group_headers for group in header_values(header))
    return Requester(user, groups)


def access_review(who: Requester, namespace: str, metric: str) -> dict[str, Any]:
    """The SubjectAccessReview asking whether `who` may read `metric` in `namespace`: list,
    the verb the API server itself checks for the path (a collection, no name)."""
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": who.user,
            "groups": list(who.groups),
            "resourceAttributes": {"group": GROUP, "version": VERSION, "resource": metric,
                                   "namespace": namespace, "verb": "list"},
        },
    }


def status(code: int, reason: str, message: str) -> web.Response:
    """An error as the API server's own: a Status object."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return web.json_response(body, status=code)


class NamespaceNotServed(Exception):
    """The operator may not read the namespace's Subscribers (it watches other namespaces)."""


# The backends of the server: the namespace's Subscribers, and a SubjectAccessReview's verdict.
ReadSubscribers = Callable[[str], Awaitable[list[dict[str, Any]]]]
ReviewAccess = Callable[[dict[str, Any]], Awaitable[bool]]


def _common_name(request: web.Request) -> str | None:
    transport = request.transport
    peer = transport.get_extra_info("peercert") if transport is not None else None
    for rdn in (peer or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def metrics_app(proxy: FrontProxy, read_subscribers: ReadSubscribers, review_access: ReviewAccess) -> web.Application:
    def who(request: web.Request) -> Requester | None:
        return requester(proxy, _common_name(request), request.headers, lambda h: request.headers.getall(h, []))

    def unauthenticated() -> web.Response:
        return status(401, "Unauthorized", "only the API server's front proxy may call this server")

    async def group_version(request: web.Request) -> web.Response:
        return web.json_response(external_metrics.resource_list()) if who(request) else unauthenticated()

    async def values(request: web.Request) -> web.Response:
        namespace, metric = request.match_info["namespace"], request.match_info["metric"]
        if metric not in external_metrics.METRICS:
            return status(404, "NotFound", f'{GROUP} "{metric}" is not a metric casque serves: '
                          f"{', '.join(external_metrics.METRICS)}")
        asker = who(request)
        if asker is None:
            return unauthenticated()
        if not await review_access(access_review(asker, namespace, metric)):
            return status(403, "Forbidden",
                          f'{asker.user} may not list {GROUP} "{metric}" in the namespace "{namespace}"')
        try:
            subscribers = await read_subscribers(namespace)
        except NamespaceNotServed:
            return status(404, "NotFound", f'casque\'s operator does not serve the namespace "{namespace}" '
                          "(the chart's operator.watchNamespaces)")
        except Exception:  # the API server unreachable or failing: the HPA asks again
            log.exception("External Metrics API: the Subscribers of %s could not be read", namespace)
            return status(503, "ServiceUnavailable", f'the Subscribers of "{namespace}" could not be read')
        try:
            answer = external_metrics.metric_values(metric, subscribers, request.query.get("labelSelector", ""),
                                                    datetime.now(UTC))
        except BadSelector as error:
            return status(400, "BadRequest", str(error))
        return web.json_response(answer)

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get(PREFIX, group_version)
    app.router.add_get(PREFIX + "/namespaces/{namespace}/{metric}", values)
    for path in ("/healthz", "/livez", "/readyz"):
        app.router.add_get(path, healthy)
    return app


def tls_context(options: MetricsApiOptions, proxy: FrontProxy) -> ssl.SSLContext:
    """Serving with the operator's certificate; a client certificate asked for and, when one
    is presented, checked against the front proxy's CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(options.certfile, options.keyfile)
    context.verify_mode = ssl.CERT_OPTIONAL
    context.load_verify_locations(cadata=proxy.client_ca)
    return context


def kubernetes_backends(api: Any) -> tuple[ReadSubscribers, ReviewAccess]:
    """The server's backends through the Kubernetes API (a `kubernetes` ApiClient): the
    Subscribers as the API server holds them, and its SubjectAccessReviews."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    custom, authorization = client.CustomObjectsApi(api), client.AuthorizationV1Api(api)

    async def read_subscribers(namespace: str) -> list[dict[str, Any]]:
        try:
            listed = await asyncio.to_thread(
                custom.list_namespaced_custom_object, resources.GROUP, resources.VERSION, namespace, resources.SUBSCRIBERS)
        except ApiException as error:
            if error.status == 403:
                raise NamespaceNotServed(namespace) from error
            raise
        assert isinstance(listed, dict)  # the client's JSON, typed as object
        return list(listed.get("items", []))

    async def review_access(review: dict[str, Any]) -> bool:
        answered = await asyncio.to_thread(authorization.create_subject_access_review, review)  # type: ignore[arg-type]
        return bool(answered.status and answered.status.allowed)

    return read_subscribers, review_access


def read_front_proxy(api: Any) -> FrontProxy:
    """kube-system's extension-apiserver-authentication, as the API server published it."""
    from kubernetes import client

    namespace, name = AUTHENTICATION_CONFIGMAP
    configmap = client.CoreV1Api(api).read_namespaced_config_map(name, namespace)
    return FrontProxy.from_configmap(configmap.data or {})


CERTIFICATE_CHECK_SECONDS = 10.0


def _certificate_stamp(options: MetricsApiOptions) -> tuple[float, ...]:
    # A mounted Secret swaps a symlink: follow it to the files behind.
    return tuple(path.resolve().stat().st_mtime for path in (options.certfile, options.keyfile))


async def _reload_renewed_certificate(context: ssl.SSLContext, options: MetricsApiOptions) -> None:
    """Load the certificate again whenever its files change (a renewed Secret): the listener
    keeps its context, and new connections get the new certificate."""
    stamp = _certificate_stamp(options)
    while True:
        await asyncio.sleep(CERTIFICATE_CHECK_SECONDS)
        try:
            now = _certificate_stamp(options)
            if now != stamp:
                context.load_cert_chain(options.certfile, options.keyfile)
                stamp = now
                log.info("External Metrics API: serving a renewed certificate")
        except (OSError, ssl.SSLError) as error:  # half-written: the next check takes it
            log.warning("External Metrics API: the certificate could not be reloaded yet: %s", error)


async def serve(options: MetricsApiOptions, proxy: FrontProxy, read_subscribers: ReadSubscribers,
                review_access: ReviewAccess) -> None:
    """Answer until cancelled."""
    runner = web.AppRunner(metrics_app(proxy, read_subscribers, review_access), access_log=None)
    await runner.setup()
    context = tls_context(options, proxy)
    site = web.TCPSite(runner, options.address, options.port, ssl_context=context)
    await site.start()
    log.info("External Metrics API listening on %s:%d", options.address, options.port)
    try:
        await _reload_renewed_certificate(context, options)
    finally:
        await runner.cleanup()


async def serve_from_cluster(options: MetricsApiOptions) -> None:
    """Answer until cancelled, with the cluster's front proxy, Subscribers and reviews (the
    credentials found as casque.operator.kube finds them)."""
    from casque.operator import kube

    api = kube.api_client()
    proxy = await asyncio.to_thread(read_front_proxy, api)
    await serve(options, proxy, *kubernetes_backends(api))
