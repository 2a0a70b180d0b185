"""The package list in pyproject.toml is written by hand (folders map to casque.*); keep it whole."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> tuple[set[str], dict[str, str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"]), config["package-dir"]


def test_every_python_package_folder_is_declared() -> None:
    declared, package_dir = _declared()
    found = set()
    for package, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            parts = [p for p in relative.parts]
            found.add(".".join([package, *parts]))
    assert found == declared


@pytest.mark.parametrize("flags", [[], ["-S"]])
def test_the_operator_folder_never_shadows_the_standard_library(flags: list[str]) -> None:
    """Even with the repository root on PYTHONPATH, `operator` is the standard library's."""
    probe = "import operator, collections; print(operator.__file__); print(operator.eq(1, 1))"
    result = subprocess.run(
        [sys.executable, *flags, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, cwd=ROOT, check=False,
    )
    assert result.returncode == 0, result.stderr
    path, equal = result.stdout.split()
    assert not path.startswith(str(ROOT)) and equal == "True"
