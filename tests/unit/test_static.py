"""Static checks run as tests: strict typing and the layering contract.

The folders operator/ and sidecar/ import as casque.operator and casque.sidecar (through
the package mapping), which mypy and import-linter cannot follow; both run on a copy of the
sources laid out as the installed package is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def package_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("layout")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "casque", tree / "casque", ignore=skip)
    shutil.copytree(ROOT / "operator", tree / "casque" / "operator", ignore=skip)
    shutil.copytree(ROOT / "sidecar", tree / "casque" / "sidecar", ignore=skip)
    # The app client is a distribution of its own (client/), checked with the rest.
    shutil.copytree(ROOT / "client" / "casque_client", tree / "casque_client", ignore=skip)
    return tree


def run(command: list[str], tree: Path) -> subprocess.CompletedProcess[str]:
    # From inside the copy, so that the copy (not the checkout or the editable install) is found.
    env = {**os.environ, "PYTHONPATH": str(tree), "MYPYPATH": str(tree)}
    return subprocess.run(command, capture_output=True, text=True, cwd=tree, env=env, timeout=600, check=False)


def test_mypy_strict(package_tree: Path) -> None:
    result = run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(ROOT / ".mypy_cache" / "layout"), "-p", "casque", "-p", "casque_client"],
        package_tree,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_layers(package_tree: Path) -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    result = run([lint, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], package_tree)
    assert result.returncode == 0, result.stdout + result.stderr


# The consumer group's modules, as the layering contract names them, plus the state they share.
CONSUMER_GROUP_MODULES = [
    "consumer", "leased_delivery", "sharing", "delivering", "acking", "foreign_ranges", "shard_reader",
    "claim_reader", "member", "leases", "session_trust", "shard_state", "entries", "keylocks", "reachability", "gaps",
]
MAX_MODULE_LINES = 500


def test_no_module_of_the_consumer_group_outgrows_one_concern() -> None:
    lengths = {name: len((ROOT / "casque" / "engine" / f"{name}.py").read_text().splitlines())
               for name in CONSUMER_GROUP_MODULES}
    too_long = {name: lines for name, lines in lengths.items() if lines > MAX_MODULE_LINES}
    assert not too_long, f"split these by concern (over {MAX_MODULE_LINES} lines): {too_long}"
