"""The lock files in requirements/ agree with pyproject.toml and with each other.

scripts/lock.sh writes them; the images install runtime.lock and build.lock, scripts/install.sh
(and so CI) installs dev.lock. A pin changed in pyproject.toml without a new lock fails here.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCAL = "casque-client"  # client/ in this repository, on no index: in no lock
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Pin:
    version: str
    hashes: frozenset[str]


def read_lock(name: str) -> dict[str, Pin]:
    """name -> pin, from pip-compile's output: `name==version \\` then `--hash=...` lines."""
    pins: dict[str, Pin] = {}
    current: tuple[str, str] | None = None
    hashes: set[str] = set()
    for line in (ROOT / "requirements" / name).read_text().splitlines() + [""]:
        stripped = line.strip()
        found = PIN.match(line)
        if found or not stripped or (not line.startswith(" ") and not stripped.startswith("#")):
            if current:
                pins[current[0]] = Pin(current[1], frozenset(hashes))
            current, hashes = None, set()
        if found:
            current = (str(canonicalize_name(found.group(1))), found.group(2))
        hashes.update(HASH.findall(line))
        if stripped and not stripped.startswith(("#", "--hash")) and not found:
            pytest.fail(f"{name}: a line that is neither a pin nor a hash: {line!r}")
    return pins


def pinned(requirements: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for line in requirements:
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"{line} is not pinned"
        result[str(canonicalize_name(requirement.name))] = specifier.version
    return result


RUNTIME = read_lock("runtime.lock")
DEV = read_lock("dev.lock")
BUILD = read_lock("build.lock")
TRACING = read_lock("tracing.lock")


@pytest.mark.parametrize("lock", ["runtime.lock", "dev.lock", "build.lock", "tracing.lock"])
def test_every_pin_has_hashes_and_nothing_points_elsewhere(lock: str) -> None:
    pins = read_lock(lock)
    assert pins and all(pin.hashes for pin in pins.values()), [n for n, p in pins.items() if not p.hashes]
    text = (ROOT / "requirements" / lock).read_text()
    # No index, find-links or editable lines: what is installed is named by hash alone.
    assert not re.search(r"^\s*(-e|--index-url|--extra-index-url|--find-links|-f)\b", text, re.M)
    assert "bash scripts/lock.sh" in text
    assert canonicalize_name(LOCAL) not in pins


def test_the_runtime_lock_holds_every_dependency_at_the_version_pyproject_pins() -> None:
    declared = pinned(PYPROJECT["project"]["dependencies"])
    declared.pop(str(canonicalize_name(LOCAL)))
    assert {name: RUNTIME[name].version for name in declared if name in RUNTIME} == declared


def test_the_dev_lock_keeps_the_runtime_pins_and_holds_the_dev_extra() -> None:
    for name, pin in RUNTIME.items():
        assert DEV.get(name) == pin, name
    dev = pinned(PYPROJECT["project"]["optional-dependencies"]["dev"])
    assert {name: DEV[name].version for name in dev if name in DEV} == dev


def test_the_build_lock_has_the_build_backend_pyproject_asks_for() -> None:
    (backend,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert backend.specifier.contains(BUILD["setuptools"].version)
    assert BUILD["setuptools"] == DEV["setuptools"]
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["build-system"]["requires"]
    assert all(Requirement(r).specifier.contains(BUILD["setuptools"].version) for r in client)


def test_the_runtime_lock_is_closed_under_the_dependencies_of_what_it_pins() -> None:
    """What each locked distribution requires (for this Python, on Linux) is locked too, at a
    version it accepts: the images install with --no-deps. Read from the dev environment, which
    dev.lock made with the same versions."""
    environment = {"extra": ""}
    for name, pin in RUNTIME.items():
        distribution = metadata.distribution(name)
        assert distribution.version == pin.version, (name, distribution.version, pin.version)
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            wanted = str(canonicalize_name(requirement.name))
            assert wanted in RUNTIME, f"{name} requires {line}, which runtime.lock lacks"
            assert requirement.specifier.contains(RUNTIME[wanted].version, prereleases=True), (name, line)


def test_the_tracing_lock_holds_the_tracing_extra_at_the_runtime_and_dev_versions() -> None:
    """The sidecar's image installs runtime.lock, then tracing.lock: what both pin must agree,
    and so must what dev.lock (the tests' environment) pins of it."""
    extra = pinned(PYPROJECT["project"]["optional-dependencies"]["tracing"])
    assert {name: TRACING[name].version for name in extra if name in TRACING} == extra
    for name, pin in TRACING.items():
        if name in RUNTIME:
            assert RUNTIME[name] == pin, name
        if name in DEV:
            assert DEV[name].version == pin.version, name
