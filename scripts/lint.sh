#!/usr/bin/env bash
# The static checks alone, from a checkout (after scripts/install.sh): the import contracts of
# pyproject.toml (layers, no circles; import-linter) and mypy --strict. One line per problem,
# file or module first; exit status 1 if there is any. tests/unit/test_static.py runs the same
# checks within the suite.
#
# operator/ and sidecar/ import as casque.operator and casque.sidecar (pyproject's
# package-dir), which neither tool can follow in the checkout: both run on a copy of the
# sources laid out as the installed package is, and name the checkout's files in their lines.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=$root/.venv/bin/python
if [ ! -x "$py" ]; then
  echo "lint: no .venv here; run scripts/install.sh first" >&2
  exit 2
fi

tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
copy() { mkdir -p "$2" && tar -C "$1" --exclude=__pycache__ -cf - . | tar -C "$2" -xf -; }
copy casque "$tree/casque"
copy operator "$tree/casque/operator"
copy sidecar "$tree/casque/sidecar"
copy client/casque_client "$tree/casque_client"
# Back from the layout to the checkout's paths.
to_checkout() { sed -e 's#^casque/operator/#operator/#' -e 's#^casque/sidecar/#sidecar/#' -e 's#^casque_client/#client/casque_client/#'; }

failed=0

# Import contracts: each broken one as "contract: the import or chain of imports that breaks it".
# (import-linter prints an empty line of its own as it builds the graph: dropped.)
if ! (cd "$tree" && PYTHONPATH=$tree "$py" - "$root/pyproject.toml" <<'PY') | sed '/^$/d'; then failed=1; fi
import sys

from importlinter import configuration
from importlinter.application import use_cases

configuration.configure()  # what the lint-imports command sets up before it reads its options

def chain(imports):
    # a -> b -> c, each step with the lines of the import that makes it: a:12 -> b:40 -> c
    steps = [f"{i['importer']}:{','.join(str(n) for n in i['line_numbers'])}" for i in imports]
    return " -> ".join([*steps, imports[-1]["imported"]])

try:
    options = use_cases.read_user_options(sys.argv[1])
    use_cases._register_contract_types(options)
    report = use_cases.create_report(options, cache_dir=None)
except Exception as error:  # a contract naming a module that is gone, a file that does not parse
    print(f"import contracts: not checked: {type(error).__name__}: {error}".replace("\n", " "))
    sys.exit(1)
broken = 0
for contract, check in report.get_contracts_and_checks():
    if check.kept:
        continue
    name, data = contract.name, check.metadata
    lines = []
    if contract.type_name == "forbidden":
        lines = [chain(c) for found in data["invalid_chains"] for c in found["chains"]]
    elif contract.type_name == "layers":
        lines = [chain(route["chain"]) for found in data["invalid_dependencies"] for route in found["routes"]]
        lines += [f"{module} is in no layer" for module in sorted(data["undeclared_modules"])]
    elif contract.type_name == "acyclic_siblings":
        lines = [f"{importer} -> {imported} closes a circle of imports"
                 for breakers in data["cycle_breakers_by_package"].values() for importer, imported in sorted(breakers)]
    for line in lines or ["broken (lint-imports --config pyproject.toml tells how)"]:
        print(f"import contract {name!r}: {line}")
        broken += 1
sys.exit(1 if broken else 0)
PY

# mypy --strict: its error lines, on the checkout's paths (notes and the summary left out).
set +e
(cd "$tree" && PYTHONPATH=$tree MYPYPATH=$tree "$py" -m mypy --strict --config-file "$root/pyproject.toml" \
  --cache-dir "$root/.mypy_cache/layout" --no-pretty --no-error-summary --hide-error-context \
  -p casque -p casque_client) > "$tree/mypy.out" 2>&1
mypy_status=$?
set -e
if [ "$mypy_status" -ne 0 ]; then
  failed=1
  if grep -q ': error:' "$tree/mypy.out"; then
    grep ': error:' "$tree/mypy.out" | to_checkout
  else
    sed 's/^/mypy: /' "$tree/mypy.out"  # it did not get as far as checking
  fi
fi

if [ "$failed" -eq 0 ]; then
  echo "lint: import contracts kept, mypy --strict clean"
fi
exit "$failed"
