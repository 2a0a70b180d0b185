#!/usr/bin/env bash
# Command 1 of the README: install casque and run it locally on its embedded default,
# a real single-node Cassandra and a real ZooKeeper started on 127.0.0.1, then a sidecar
# serving a demo queue, and a short demo of its HTTP API. Running it again is harmless:
# the stack is found running, the demo queue is already there, the sidecar is restarted.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/casque dev up

state="${CASQUE_STATE_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/casque/dev}"
port="${CASQUE_SIDECAR_PORT:-8717}"
api="http://127.0.0.1:${port}"
queue=demo
subscriber=demo-app
pidfile="$state/sidecar.pid"
logfile="$state/sidecar.log"
mkdir -p "$state"

# The demo Queue and Subscriber, through the catalog (what the operator does for the CRs).
.venv/bin/python - "$queue" "$subscriber" <<'PY'
import sys

from casque.config import Settings
from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

queue, subscriber = QueueRef("default", sys.argv[1]), sys.argv[2]
store = Store.open(Settings())
try:
    catalog.ensure_installation(store)
    catalog.apply_queue(store, queue, QueueSpec(shards=2, retention_seconds=86400, consistency="ONE"))
    catalog.apply_subscriber(store, queue, subscriber,
                             SubscriberSpec(queue=queue.name, start_position="earliest", visibility_timeout_seconds=30))
    print(f"queue {queue} (2 shards, 1 day retention) and its subscriber {subscriber} are in place")
finally:
    store.close()
PY

# One sidecar at a time: stop the one an earlier run started (it drains, then exits).
if [ -f "$pidfile" ]; then
  old="$(cat "$pidfile")"
  if kill -0 "$old" 2>/dev/null && grep -q "casque" "/proc/$old/cmdline" 2>/dev/null; then
    echo "stopping the sidecar of an earlier run (pid $old)"
    kill -TERM "$old"
    for _ in $(seq 1 300); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$old" 2>/dev/null; then kill -KILL "$old"; fi
  fi
  rm -f "$pidfile"
fi

logged="$(stat -c %s "$logfile" 2>/dev/null || echo 0)"
nohup .venv/bin/casque sidecar --queue "$queue" --subscriber "$subscriber" --port "$port" \
  --drain-seconds 5 >>"$logfile" 2>&1 &
echo $! >"$pidfile"
if [ "$port" = 0 ]; then
  # Port 0: the sidecar takes a free port and logs it; read it from what this start logged.
  for _ in $(seq 1 600); do
    api="$(tail -c +"$((logged + 1))" "$logfile" | grep -o 'casque sidecar listening on http://[^ ]*' | head -n 1 | cut -d' ' -f5 || true)"
    if [ -n "$api" ] || ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then break; fi
    sleep 0.1
  done
fi

# curl where it exists; Python otherwise (a fresh Debian image may have no curl).
call() { # METHOD PATH [JSON]
  if command -v curl >/dev/null 2>&1; then
    curl -sS -X "$1" "$api$2" -H 'Content-Type: application/json' ${3:+-d "$3"}
  else
    .venv/bin/python -c 'import sys, urllib.request
r = urllib.request.Request(sys.argv[2], data=sys.argv[3].encode() if len(sys.argv) > 3 else None, method=sys.argv[1],
                           headers={"Content-Type": "application/json"})
print(urllib.request.urlopen(r).read().decode())' "$1" "$api$2" ${3:+"$3"}
  fi
}

ready=""
for _ in $(seq 1 600); do
  if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then break; fi
  if .venv/bin/python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' \
      "$api/readyz" >/dev/null 2>&1; then ready=yes; break; fi
  sleep 0.1
done
if [ -z "$ready" ]; then
  echo "the sidecar did not become ready; its log ($logfile) ends with:" >&2
  tail -n 20 "$logfile" >&2
  exit 1
fi
echo "sidecar on $api (pid $(cat "$pidfile"), log $logfile)"

echo
echo "== demo: publish three messages"
call POST "/v1/queues/$queue/messages" '{"data": {"order": 1, "item": "tea"}, "partitionkey": "customer-7"}'; echo
call POST "/v1/queues/$queue/messages/batch" \
  '{"messages": [{"data": {"order": 2, "item": "cake"}}, {"data": "a text message", "datacontenttype": "text/plain"}]}'
echo
echo "== demo: receive (long poll) and ack"
received="$(call POST "/v1/queues/$queue/subscribers/$subscriber/receive" '{"max": 100, "wait": 5}')"
echo "$received" | .venv/bin/python -c 'import json, sys
for m in json.load(sys.stdin)["messages"]:
    print("  %s/%s/%s  delivery %s  %s" % (m["shard"], m["batch"], m["seq"], m["deliverycount"], json.dumps(m.get("data"))))'
receipts="$(echo "$received" | .venv/bin/python -c 'import json, sys
print(json.dumps({"receipts": [m["receipt"] for m in json.load(sys.stdin)["messages"]]}))')"
if [ "$receipts" != '{"receipts": []}' ]; then
  call POST "/v1/queues/$queue/subscribers/$subscriber/ack" "$receipts" >/dev/null
  echo "  acked"
fi
echo
echo "== demo: stats"
.venv/bin/casque stats "$queue"

cat <<TXT

casque's local stack and a sidecar are up. Try the API yourself:
  curl -s -X POST $api/v1/queues/$queue/messages -H 'Content-Type: application/json' \\
       -d '{"data": {"hello": "world"}, "partitionkey": "k1"}'
  curl -s -X POST $api/v1/queues/$queue/subscribers/$subscriber/receive -H 'Content-Type: application/json' \\
       -d '{"max": 10, "wait": 20}'
  curl -s -X POST $api/v1/queues/$queue/subscribers/$subscriber/ack -H 'Content-Type: application/json' \\
       -d '{"receipt": "<receipt from receive>"}'
  curl -s -X POST $api/v1/queues/$queue/subscribers/$subscriber/nack -H 'Content-Type: application/json' \\
       -d '{"receipt": "<receipt from receive>", "delay": 60}'
  curl -s -X POST $api/v1/queues/$queue/subscribers/$subscriber/seek -H 'Content-Type: application/json' \\
       -d '{"to": "earliest"}'
  curl -s $api/v1/queues/$queue/subscribers/$subscriber/stats
  curl -s $api/openapi.json          # the whole API;  $api/metrics for Prometheus
From the terminal:
  .venv/bin/casque publish $queue '{"hello": "cli"}'
  .venv/bin/casque tail $queue               # follow new messages without consuming them
  .venv/bin/casque stats $queue --watch
  .venv/bin/casque dev status                # what runs, where, and its logs
  kill \$(cat $pidfile)              # stop the sidecar (it drains first)
  .venv/bin/casque dev down                  # stop exactly what was started
TXT
