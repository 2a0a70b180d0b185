"""The `casque` command's exit codes: the one table, and the one place errors become them.

| code | meaning |
| ---- | ------- |
| 0 | done |
| 1 | refused: the input or the request breaks a rule (a bad spec, fewer shards, a stale position, ...) |
| 2 | usage: the command line itself is wrong (typer's own errors exit 2 too) |
| 3 | not found: the queue or subscriber named does not exist |
| 4 | backend unavailable: Cassandra, ZooKeeper or a service of the local stack is down or unreachable |
| 130 | interrupted (Ctrl-C) |

docs/cli.md shows the same table; tests/unit/test_cli_output.py keeps the two in step.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from enum import IntEnum
from typing import ParamSpec, TypeVar

import typer

from casque.errors import BackendUnavailable, CasqueError, MessageNotFound, QueueNotFound, SubscriberNotFound

P = ParamSpec("P")
R = TypeVar("R")


class ExitCode(IntEnum):
    OK = 0
    REFUSED = 1
    USAGE = 2
    NOT_FOUND = 3
    BACKEND_UNAVAILABLE = 4
    INTERRUPTED = 130


class UsageError(CasqueError):
    """The command line is wrong in a way the option parser cannot see (exclusive options, a bad NAME=VALUE)."""

    code = "invalid_argument"


def exit_code(error: CasqueError) -> ExitCode:
    if isinstance(error, UsageError):
        return ExitCode.USAGE
    if isinstance(error, QueueNotFound | SubscriberNotFound | MessageNotFound):
        return ExitCode.NOT_FOUND
    if isinstance(error, BackendUnavailable):
        return ExitCode.BACKEND_UNAVAILABLE
    return ExitCode.REFUSED


def report(error: CasqueError) -> ExitCode:
    """Print the error as one line on stderr and give its exit code."""
    print(f"casque: {error}", file=sys.stderr)
    return exit_code(error)


def guarded(command: Callable[P, R]) -> Callable[P, R]:
    """`command` with casque's errors turned into one line and their exit code.

    Inside the command rather than around the whole program, so that typer's test runner
    (and anything else that calls the typer app) sees the same codes as a shell does.
    """

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except CasqueError as error:
            raise typer.Exit(report(error)) from error

    return run


def guard_all(app: typer.Typer) -> None:
    """Wrap every command of `app` and of its sub-apps with `guarded`."""
    for info in app.registered_commands:
        if info.callback is not None:
            info.callback = guarded(info.callback)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            guard_all(group.typer_instance)
