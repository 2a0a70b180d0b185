#!/usr/bin/env bash
# Regenerates the lock files in requirements/ from pyproject.toml, with a hash for every file
# of every pinned distribution, so that an install from them fetches exactly those bytes:
#
#   requirements/runtime.lock  casque's dependencies and theirs: what the images install
#                              (Dockerfile.operator, Dockerfile.sidecar)
#   requirements/tracing.lock  the tracing extra (OpenTelemetry and its OTLP exporter) and what
#                              it needs beyond runtime.lock: what the sidecar's image adds
#                              (Dockerfile.sidecar); resolved with runtime.lock as constraints
#   requirements/build.lock    what builds casque's and the client's wheels in an image
#   requirements/dev.lock      the runtime lock plus the dev extra and its dependencies: what
#                              scripts/install.sh installs into .venv (and so what CI tests);
#                              resolved with runtime.lock as constraints, so both agree
#
# Run it after changing a pin in pyproject.toml; tests/unit/test_locks.py fails until then.
# casque-client is left out of every lock: it is the client/ folder of this repository, on no
# index, and is installed from there. pip-tools is pinned and kept in its own virtualenv under
# ${CASQUE_CACHE:-~/.cache/casque}/pip-tools.
set -euo pipefail
cd "$(dirname "$0")/.."

PIP_TOOLS_VERSION="7.6.2"
PIP_VERSION="25.2"
tools="${CASQUE_CACHE:-$HOME/.cache/casque}/pip-tools/${PIP_TOOLS_VERSION}"
if [ ! -x "$tools/bin/pip-compile" ]; then
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install -q "pip==$PIP_VERSION" "pip-tools==$PIP_TOOLS_VERSION"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The inputs, read from pyproject.toml: the same pins, one a line.
python3 - "$work" <<'PY'
import sys, tomllib
from pathlib import Path

out = Path(sys.argv[1])
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
build = tomllib.loads(Path("pyproject.toml").read_text())["build-system"]
local = "casque-client"
runtime = [r for r in project["dependencies"] if not r.startswith(local)]
(out / "runtime.in").write_text("\n".join(runtime) + "\n")
(out / "tracing.in").write_text("\n".join(project["optional-dependencies"]["tracing"]) + "\n")
(out / "dev.in").write_text("\n".join(runtime + project["optional-dependencies"]["dev"]) + "\n")
# The build backend at the version the dev extra pins (the unit tests build wheels with it).
setuptools = [r for r in project["optional-dependencies"]["dev"] if r.startswith("setuptools==")]
assert setuptools and any(r.startswith("setuptools") for r in build["requires"]), setuptools
(out / "build.in").write_text("\n".join(setuptools) + "\n")
PY

compile() {
  local name="$1"; shift
  # Run from the scratch folder so that the headers name the input, not a temporary path.
  (cd "$work" && CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" "$tools/bin/pip-compile" -q \
    --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links --resolver=backtracking \
    "$@" --output-file "$name.lock" "$name.in")
  cp "$work/$name.lock" "requirements/$name.lock"
}

mkdir -p requirements
compile runtime
compile build
cp requirements/runtime.lock "$work/runtime.lock"
compile dev --constraint runtime.lock
# The tracing extra at the runtime lock's versions: the sidecar's image installs
# runtime.lock, then this (what the two share is already there), and pip check proves the whole.
compile tracing --constraint runtime.lock
echo "lock: $(ls requirements/*.lock | tr '\n' ' ')"
