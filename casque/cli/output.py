"""`-o/--output` for every command: the human form, or the same data as JSON or YAML.

The machine forms print the data the command already computed, so a script that reads
`-o json` sees what a person reads in the table, and `casque get ... -o yaml` prints
documents that `casque apply -f` takes back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console, RenderableType
from rich.measure import Measurement

from casque.cli.exits import UsageError

MACHINE = ("json", "yaml")


TableOutput = Annotated[str, typer.Option("--output", "-o", help="table, json or yaml.")]
# Listings (`get`): `wide` adds the columns `kubectl get -o wide` shows.
ListOutput = Annotated[str, typer.Option("--output", "-o", help="table, wide, json or yaml.")]
TextOutput = Annotated[str, typer.Option("--output", "-o", help="text, json or yaml.")]


def check(output: str, allowed: Sequence[str]) -> str:
    if output not in allowed:
        raise UsageError(f"--output is {', '.join(allowed[:-1])} or {allowed[-1]}, not {output!r}")
    return output


def dumps(data: Any, output: str) -> str:
    """`data` (JSON-compatible) as JSON or YAML text."""
    if output == "json":
        return json.dumps(data, indent=2, ensure_ascii=False)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n")


def dumps_all(documents: Sequence[Any], output: str) -> str:
    """Several documents: a JSON list, or a YAML stream (documents separated by ---)."""
    if output == "json":
        return json.dumps(list(documents), indent=2, ensure_ascii=False)
    return yaml.safe_dump_all(list(documents), sort_keys=False, allow_unicode=True).rstrip("\n")


def emit(data: Any, output: str) -> None:
    typer.echo(dumps(data, output))


def print_whole(renderable: RenderableType, console: Console) -> None:
    """Print a listing at its own width, as kubectl does: a line longer than the terminal
    wraps, while a table fitted to the terminal would cut names and ids short (`billi…`)."""
    natural = Measurement.get(console, console.options.update_width(10_000), renderable).maximum
    # A console of that width: print(width=...) is capped at the console's own.
    Console(width=max(console.width, natural)).print(renderable)
