#!/usr/bin/env bash
# Command 1 of the README: install casque and run it locally on its embedded default,
# a real single-node Cassandra and a real ZooKeeper started on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/casque dev up
cat <<TXT

casque's local stack is up. Next:
  .venv/bin/casque dev status        # what runs, where, and its logs
  .venv/bin/casque dev logs cassandra-1
  .venv/bin/casque dev down          # stop exactly what was started
TXT
