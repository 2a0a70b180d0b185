"""What a `casque` process loads (casque/cli/__init__.py, casque/cli/main.py): the sidecar
only what serving needs, not the other commands' modules; no command NumPy, which the
Cassandra driver would load only because it is installed, but `casque spark`, whose report
draws with matplotlib."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

LOADED = """
import sys
from casque.cli.main import sidecar_app, whole_app
sidecar_app() if sys.argv[1] == "sidecar" else whole_app()
import casque.sidecar.server
import cassandra.cluster
print(" ".join(sorted(name for name, module in sys.modules.items() if module is not None)))
"""


def loaded_by(command: str) -> set[str]:
    """The modules loaded by a process whose arguments are those of `casque COMMAND` (what
    casque.cli looks at), once it has its command and the sidecar's server and driver."""
    assert importlib.util.find_spec("numpy") is not None, "numpy is installed here (matplotlib's), as this test needs"
    done = subprocess.run([sys.executable, "-c", LOADED, command], capture_output=True, text=True, timeout=120,
                          check=True)
    return set(done.stdout.split())


def test_the_sidecar_process_loads_neither_numpy_nor_the_other_commands() -> None:
    loaded = loaded_by("sidecar")
    assert {"cassandra.cluster", "aiohttp.web", "casque.sidecar.server"} <= loaded
    assert "numpy" not in loaded
    assert not {"casque.cli.queue_commands", "casque.cli.spark_commands", "casque.operator.main"} & loaded


@pytest.mark.parametrize(("command", "numpy"), [("operator", False), ("publish", False), ("spark", True)])
def test_only_the_spark_commands_let_the_driver_load_numpy(command: str, numpy: bool) -> None:
    assert ("numpy" in loaded_by(command)) is numpy
