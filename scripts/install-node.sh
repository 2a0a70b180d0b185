#!/usr/bin/env bash
# Prepares the node test (tests/integration/test_node.py), idempotently: Debian's containerd,
# runc and CNI plugins (containernetworking-plugins, in /usr/lib/cni), iptables for kube-proxy,
# and ipset for kube-router's firewall (the node's NetworkPolicies). Nothing is configured or started here: the test runs containerd with a
# configuration, root, state and socket of its own (casque.devstack.node), so a containerd
# of the host, if any, is left as it is. The kubelet and the controllers come from
# scripts/install-kube-tools.sh, the images from scripts/install-podman.sh's base.
#
#   bash scripts/install-node.sh
set -euo pipefail

for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "install-node: unknown argument: $arg" >&2; exit 2 ;;
  esac
done
sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"

need=()
for pkg in containerd runc containernetworking-plugins iptables ipset iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "install-node: installing ${need[*]} (apt)" >&2
  $sudo_cmd apt-get update -qq
  # --no-install-recommends: no service is enabled or started by recommended packages.
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
echo "containerd $(containerd --version | cut -d' ' -f3), runc $(runc --version | sed -n '1s/runc version //p'), CNI plugins in /usr/lib/cni"
