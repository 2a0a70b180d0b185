"""The `casque sidecar` process loads what serving needs: not the other commands' modules
(casque/cli/main.py), nor NumPy, which the Cassandra driver would load only because it is
installed (casque/cli/__init__.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

LOADED = """
import sys
from casque.cli.main import sidecar_app
sidecar_app()
import casque.sidecar.server
print(" ".join(sorted(name for name, module in sys.modules.items() if module is not None)))
"""


def test_the_sidecar_process_loads_neither_numpy_nor_the_other_commands() -> None:
    assert importlib.util.find_spec("numpy") is not None, "numpy is installed here (matplotlib's), as this test needs"
    # Its arguments as `casque sidecar` has them: that is what casque.cli looks at.
    done = subprocess.run([sys.executable, "-c", LOADED, "sidecar"], capture_output=True, text=True, timeout=120,
                          check=True)
    loaded = set(done.stdout.split())
    assert {"cassandra.cluster", "aiohttp.web", "casque.sidecar.server"} <= loaded
    assert "numpy" not in loaded
    assert not {"casque.cli.queue_commands", "casque.cli.spark_commands", "casque.operator.main"} & loaded
