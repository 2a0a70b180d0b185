"""The package list in pyproject.toml is written by hand (folders map to casque.*); keep it whole."""

import tomllib
from pathlib import Path

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


def test_no_package_shadows_the_standard_library() -> None:
    import operator

    assert not operator.__file__.startswith(str(ROOT))
