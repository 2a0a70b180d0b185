"""The CLI's exit codes and output forms, without backends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from casque.cli.exits import ExitCode, UsageError, exit_code, guarded
from casque.cli.main import app
from casque.cli.output import check, dumps, dumps_all
from casque.errors import (
    BackendUnavailable,
    CasqueError,
    InvalidSpec,
    MessageNotFound,
    PublishOutcomeUnknown,
    QueueNotFound,
    SubscriberNotFound,
    UntraceableId,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("error", "code"), [
    (UsageError("x"), 2), (QueueNotFound("x"), 3), (SubscriberNotFound("x"), 3), (MessageNotFound("x"), 3),
    (UntraceableId("x"), 1), (BackendUnavailable("x"), 4),
    (PublishOutcomeUnknown("x"), 4), (InvalidSpec("x"), 1), (CasqueError("x"), 1),
])
def test_each_error_has_one_exit_code(error: CasqueError, code: int) -> None:
    assert exit_code(error) == code


def test_the_documented_table_is_the_code() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    table = text[text.index("<!-- exit-codes:begin -->"):text.index("<!-- exit-codes:end -->")]
    documented = {int(code) for code in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)}
    assert documented == {int(code) for code in ExitCode}


def test_a_guarded_command_prints_one_line_and_exits_with_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    import typer

    def missing() -> None:
        raise QueueNotFound("queue default/nope does not exist")

    with pytest.raises(typer.Exit) as exited:
        guarded(missing)()
    assert exited.value.exit_code == 3
    assert capsys.readouterr().err == "casque: queue default/nope does not exist\n"


def test_output_forms() -> None:
    data = {"b": 1, "a": [1, 2]}
    assert yaml.safe_load(dumps(data, "yaml")) == data and list(yaml.safe_load(dumps(data, "yaml"))) == ["b", "a"]
    assert list(yaml.safe_load_all(dumps_all([data, data], "yaml"))) == [data, data]
    assert dumps_all([], "json") == "[]"
    assert check("yaml", ("table", "json", "yaml")) == "yaml"
    with pytest.raises(UsageError, match="--output is table, json or yaml, not 'xml'"):
        check("xml", ("table", "json", "yaml"))


def test_usage_errors_exit_2_before_any_backend_is_touched() -> None:
    runner = CliRunner()
    for args in (["get", "queues", "-o", "xml"], ["get", "nothing"], ["describe", "queue"],
                 ["stats", "orders", "--watch", "-o", "json"], ["seek", "orders", "billing"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output, result.stderr)


def test_completion_is_offered() -> None:
    assert "--install-completion" in CliRunner().invoke(app, ["--help"]).output


def test_the_wide_subscriber_listing_shows_the_delivery_mode_and_the_filter() -> None:
    from rich.console import Console

    from casque.cli.resources import subscriber_table

    document = {"spec": {"queue": "orders", "delivery": "shared", "filter": "priority >= 1"},
                "status": {"lagMessages": 3, "members": []},
                "metadata": {"name": "big-orders", "namespace": "shop", "creationTimestamp": "2026-12-01T00:00:00Z"}}
    console = Console(width=300, record=True)
    console.print(subscriber_table([document], namespaces=False, wide=True))
    header, row = console.export_text().splitlines()[:2]
    assert header.split()[-2:] == ["DELIVERY", "FILTER"]
    assert row.split()[-4:] == ["shared", "priority", ">=", "1"]
    narrow = Console(width=300, record=True)
    narrow.print(subscriber_table([document], namespaces=False))
    assert narrow.export_text().splitlines()[0].split()[-1] == "AGE"  # no DELIVERY nor FILTER column
