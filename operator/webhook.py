"""The sidecar-injection webhook's server, run beside the operator: admission requests
answered by casque.operator.injection (the patch planner), and the namespaces of injected
pods handed to casque.operator.copies (the Secrets their sidecars need)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from casque.config import Settings
from casque.operator import copies, kube
from casque.operator.injection import InjectionSettings, answer, outcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WebhookOptions:
    """Where the webhook listens. The API server only calls webhooks over HTTPS."""

    port: int
    certfile: Path
    keyfile: Path
    address: str = "0.0.0.0"


async def serve(options: WebhookOptions, settings: InjectionSettings, backends: Settings,
                injected: Callable[[str], None] | None = None) -> None:
    """Answer admission requests until cancelled, on any path (the chart uses /inject).
    `injected` is told the namespace of each pod that gets a sidecar, after the answer is made.

    kopf's server re-reads the certificate files when they change (a renewed Secret) and
    restarts its listener with them.
    """
    import kopf

    async def respond(
        request: Any,
        *,
        webhook: str | None = None,
        headers: Mapping[str, str] | None = None,
        sslpeer: Mapping[str, Any] | None = None,
    ) -> Any:
        answered = answer(request, settings, backends)
        namespace = (request.get("request") or {}).get("namespace")
        if injected is not None and namespace and outcome(answered) == "injected":
            injected(str(namespace))
        return answered

    server = kopf.WebhookServer(
        addr=options.address, port=options.port, certfile=options.certfile, pkeyfile=options.keyfile
    )
    async for client_config in server(respond):
        log.info("sidecar-injection webhook listening at %s", client_config.get("url"))


async def serve_with_copier(options: WebhookOptions, settings: InjectionSettings) -> None:
    """The webhook as the operator's pods run it: each injected pod's namespace handed to the
    copier of the Secrets its sidecar needs (when the operator knows its own namespace)."""
    backends = Settings()
    copier = None
    source_namespace = os.environ.get("POD_NAMESPACE")
    names = copies.source_names(settings, backends)
    if source_namespace and names:
        copier = copies.WebhookCopier(kube.api_client, source_namespace, names, copies.copied_keys(settings, backends))
    await serve(options, settings, backends, copier.schedule if copier is not None else None)
