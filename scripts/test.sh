#!/usr/bin/env bash
# Command 2 of the README: install everything, then run the whole test suite against real
# servers that the tests start themselves (Cassandra, ZooKeeper and a ZooKeeper ensemble,
# kube-apiserver with etcd, Spark in local mode and as a standalone master and worker), and
# the operator's and the sidecar's images built and run with podman, and on a kubelet node
# (containerd from scripts/install-node.sh) with the chart and the example app.
#
# CASQUE_TEST_STRESS=1 runs the suite with a CPU hog beside it (one busy process per core),
# as on a machine shared with other work: a test that fails only then is still a bug.
#
# Three workers run the suite (pytest-xdist; CASQUE_TEST_WORKERS changes how many, 0 runs it
# in this process). Its tests wait on servers (sessions expiring, pods starting) as much as
# they compute: with two workers a clean-clone run kept the 2 cores busy 71% of its 2,857 s,
# with three 82% of 2,147 s (scripts/cpu_by_process.py, which .ci/run prints). Each worker is
# a session with its own slot of servers (tests/fixtures/stack.py). tests/conftest.py gives
# xdist the scheduler of tests/fixtures/scheduling.py: a module, or the modules sharing a
# costly server, run whole on one worker, the heaviest first. It takes over any --dist but
# "each"; loadscope names what it is, xdist's loadscope with larger units and an order of its
# own (loadgroup would mean xdist_group marks, which under pytest 9 xdist 3.8 cannot apply).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each install step, timed. On a fresh machine the Kubernetes components take most of it,
# built by the Go compiler on every core; the other steps mostly fetch and unpack, so they
# run beside that build (each step is idempotent and takes its own lock).
install_step() {
  local step_started
  step_started=$(date +%s)
  bash "scripts/$1.sh"
  echo "test.sh: $1 took $(( $(date +%s) - step_started ))s"
}
install_started=$(date +%s)
( install_step install-kube-tools 2>&1 | sed -u 's/^/[kube-tools] /' ) &
kube_tools=$!
for step in install install-spark install-podman install-node install-releases install-openapi-generator; do
  install_step "$step"
done
if ! wait "$kube_tools"; then
  echo "test.sh: install-kube-tools failed (its lines above start with [kube-tools])" >&2
  exit 1
fi
echo "test.sh: installing took $(( $(date +%s) - install_started ))s"
workers=()
if [ "${CASQUE_TEST_WORKERS:-3}" != "0" ]; then
  workers=(-n "${CASQUE_TEST_WORKERS:-3}" --dist loadscope)
fi
if [ "${CASQUE_TEST_STRESS:-0}" = "1" ]; then
  hogs=()
  for _ in $(seq "$(nproc)"); do
    nice -n 0 sh -c 'while :; do :; done' &
    hogs+=("$!")
  done
  trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
  echo "stress: ${#hogs[@]} CPU hog(s) beside the suite (pids ${hogs[*]})"
  .venv/bin/python -m pytest "${workers[@]}" "$@"
else
  exec .venv/bin/python -m pytest "${workers[@]}" "$@"
fi
