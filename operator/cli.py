"""`casque operator run`: the operator's command line (registered in casque.cli.main)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

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
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log more.")] = False,
) -> None:
    """Run the operator: reconcile Queues and Subscribers into Cassandra and ZooKeeper.

    Backend connection settings come from CASQUE_* environment variables (see casque.config).
    """
    # Imported here so that other `casque` commands do not pay for loading kopf.
    import kopf

    from casque.operator import runtime
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
    kopf.configure(verbose=verbose)
    raise typer.Exit(runtime.main(runtime.RunOptions(namespaces=namespaces, liveness=liveness, lease=lease)))
