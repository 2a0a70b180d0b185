#!/usr/bin/env bash
# The previous releases of casque that the tests run beside main (mixed versions in one group,
# upgrades and rollbacks), from scripts/releases.txt: each built from its commit (`git
# archive`, so this needs the repository's history, as any clone has) into a virtualenv of
# its own under $CASQUE_CACHE/releases/<version>, with that commit's locked runtime
# dependencies (hash-checked) and casque and its client installed as packages, not editable:
# its processes import that release whatever their working directory. Once per commit (a stamp).
# Where podman is installed, also the wheels that release's image builds install
# (scripts/locked-wheels.sh, from its own locks): the node tests build its operator and sidecar
# images from the same source (tests/fixtures/images.py `release_images`).
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${CASQUE_CACHE:-$HOME/.cache/casque}/releases"
python=${PYTHON:-python3}
while read -r version commit; do
  case "$version" in ''|'#'*) continue ;; esac
  target="$cache/$version"
  if [ -f "$target/.installed-$commit" ]; then
    if command -v podman >/dev/null; then bash scripts/locked-wheels.sh "$target/src" </dev/null; fi
    continue
  fi
  if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
    # A shallow clone lacks the commit: the tests that need the release say so and skip.
    echo "release $version: commit $commit is not in this clone's history; not built"
    continue
  fi
  echo "building release $version ($commit) into $target"
  rm -rf "$target"
  mkdir -p "$target/src"
  git archive "$commit" | tar -x -C "$target/src"
  "$python" -m venv "$target/venv"
  "$target/venv/bin/python" -m pip install -q --require-hashes --no-deps -r "$target/src/requirements/build.lock"
  "$target/venv/bin/python" -m pip install -q --require-hashes --no-deps -r "$target/src/requirements/runtime.lock"
  "$target/venv/bin/python" -m pip install -q --no-deps --no-build-isolation "$target/src/client" "$target/src"
  touch "$target/.installed-$commit"
  if command -v podman >/dev/null; then bash scripts/locked-wheels.sh "$target/src" </dev/null; fi
done < scripts/releases.txt
