"""`casque operator run`: the operator's command line (registered in casque.cli.main)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer

from casque import logs
from casque.logs import LOG_FORMAT_ENV, LogFormat

app = typer.Typer(help="The Kubernetes operator for Queue and Subscriber resources.", no_args_is_help=True)


@app.command()
def run(
    namespace: Annotated[
        list[str] | None, typer.Option("--namespace", "-n", help="Serve this namespace (repeatable).")
    ] = None,
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Serve every namespace.")] = False,
    liveness: Annotated[
        str | None,
        typer.Option(help="Serve the liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz."),
    ] = None,
    leader_election: Annotated[
        bool, typer.Option("--leader-election/--no-leader-election", help="Act only while holding a Lease.")
    ] = True,
    lease_name: Annotated[str, typer.Option(help="Name of the Lease the replicas compete for.")] = "casque-operator",
    lease_namespace: Annotated[
        str | None,
        typer.Option(help="Namespace of the Lease (default: $POD_NAMESPACE, else the first --namespace, else default)."),
    ] = None,
    lease_duration: Annotated[float, typer.Option(help="Seconds a silent leader keeps the Lease.")] = 15.0,
    renew_deadline: Annotated[float, typer.Option(help="Seconds without renewal after which a leader stops.")] = 10.0,
    retry_period: Annotated[float, typer.Option(help="Seconds between attempts to acquire or renew.")] = 2.0,
    identity: Annotated[str | None, typer.Option(help="This replica's name in the Lease (default: host name + random).")] = None,
    webhook_port: Annotated[
        int | None,
        typer.Option(envvar="CASQUE_OPERATOR_WEBHOOK_PORT", help="Serve the sidecar-injection webhook (HTTPS) on this port."),
    ] = None,
    webhook_address: Annotated[
        str, typer.Option(envvar="CASQUE_OPERATOR_WEBHOOK_ADDRESS", help="Address the webhook and the External Metrics API listen on.")
    ] = "0.0.0.0",
    webhook_cert: Annotated[
        Path | None, typer.Option(envvar="CASQUE_OPERATOR_WEBHOOK_CERT", help="The webhook's TLS certificate (PEM).")
    ] = None,
    webhook_key: Annotated[
        Path | None, typer.Option(envvar="CASQUE_OPERATOR_WEBHOOK_KEY", help="The webhook's TLS private key (PEM).")
    ] = None,
    metrics_api_port: Annotated[
        int | None,
        typer.Option(envvar="CASQUE_OPERATOR_METRICS_API_PORT",
                     help="Serve the External Metrics API (HTTPS, for the aggregation layer) on this port."),
    ] = None,
    metrics_api_cert: Annotated[
        Path | None,
        typer.Option(envvar="CASQUE_OPERATOR_METRICS_API_CERT", help="The External Metrics API's TLS certificate (PEM)."),
    ] = None,
    metrics_api_key: Annotated[
        Path | None,
        typer.Option(envvar="CASQUE_OPERATOR_METRICS_API_KEY", help="The External Metrics API's TLS private key (PEM)."),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(envvar="CASQUE_OPERATOR_METRICS_PORT", help="Serve Prometheus metrics on this port (all addresses)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log more.")] = False,
    log_format: Annotated[
        LogFormat,
        typer.Option("--log-format", envvar=LOG_FORMAT_ENV, help="Log lines as text, or one JSON object each."),
    ] = "text",
) -> None:
    """Run the operator: reconcile Queues and Subscribers into Cassandra and ZooKeeper.

    Backend connection settings come from CASQUE_* environment variables (see casque.config);
    the injected sidecar's from CASQUE_INJECTION_* (see casque.operator.injection).
    """
    # Imported here so that other `casque` commands do not pay for loading kopf.
    import kopf

    from casque.operator import injection, metrics_api, runtime
    from casque.operator import webhook as webhook_server
    from casque.operator.beside import run_beside
    from casque.operator.leadership import LeaseConfig

    namespaces = tuple(namespace or ())
    if bool(namespaces) == all_namespaces:
        raise typer.BadParameter("give --namespace (one or more) or --all-namespaces")
    lease = None
    if leader_election:
        try:
            lease = LeaseConfig(
                name=lease_name,
                namespace=lease_namespace or os.environ.get("POD_NAMESPACE") or (namespaces or ("default",))[0],
                identity=identity or runtime.default_identity(),
                duration=lease_duration,
                renew_deadline=renew_deadline,
                retry_period=retry_period,
            )
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error
    servers = {}
    if webhook_port is not None:
        webhook_cert, webhook_key = _tls_files("--webhook", webhook_cert, webhook_key)
        try:
            sidecar = injection.InjectionSettings()
        except ValueError as error:
            raise typer.BadParameter(f"CASQUE_INJECTION_* settings: {error}") from error
        webhook = webhook_server.WebhookOptions(webhook_port, webhook_cert, webhook_key, webhook_address)
        servers["sidecar-injection webhook"] = webhook_server.serve_with_copier(webhook, sidecar)
    if metrics_api_port is not None:
        metrics_api_cert, metrics_api_key = _tls_files("--metrics-api", metrics_api_cert, metrics_api_key)
        servers["External Metrics API"] = metrics_api.serve_from_cluster(
            metrics_api.MetricsApiOptions(metrics_api_port, metrics_api_cert, metrics_api_key, webhook_address))
    kopf.configure(verbose=verbose)
    if log_format == "json":
        # kopf installs its own handler (and its object references as `extra` fields, which
        # the JSON lines keep); only its formatter is replaced.
        logs.reformat(log_format)
    if metrics_port is not None:
        import prometheus_client

        prometheus_client.start_http_server(metrics_port)
    options = runtime.RunOptions(namespaces=namespaces, liveness=liveness, lease=lease)
    if not servers:
        raise typer.Exit(runtime.main(options))
    raise typer.Exit(asyncio.run(run_beside(runtime.run(options), servers)))


def _tls_files(option: str, cert: Path | None, key: Path | None) -> tuple[Path, Path]:
    """A server's certificate and key, both given and both files."""
    if cert is None or key is None:
        raise typer.BadParameter(f"{option}-port needs {option}-cert and {option}-key")
    for path in (cert, key):
        if not path.is_file():
            raise typer.BadParameter(f"{path} is not a file ({option}-cert, {option}-key)")
    return cert, key
