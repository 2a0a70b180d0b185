#!/usr/bin/env bash
# Install kube-apiserver, kubectl, etcd and helm for casque's Kubernetes tests, and the node's
# kubelet, kube-scheduler, kube-controller-manager and kube-proxy, CoreDNS, the node's cluster
# DNS, and kube-router, whose firewall enforces the node's NetworkPolicies
# (tests/integration/test_node.py).
#
# Everything is built from source with the Go toolchain, fetching code only from
# the Go module proxy, so it works on machines that can reach package registries
# but not GitHub release downloads.
#
#   bash scripts/install-kube-tools.sh            # build what is missing
#   bash scripts/install-kube-tools.sh --force    # rebuild everything
#
# Output:  ${CASQUE_CACHE:-$HOME/.cache/casque}/kube/bin/{kube-apiserver,kubectl,etcd,helm,
#          kubelet,kube-scheduler,kube-controller-manager,kube-proxy,coredns,kube-router}
# Each binary has a stamp file (bin/.stamps/<tool>) recording the pinned version
# and build recipe; when every stamp matches, the script exits immediately.
# The Go module and build caches (GOMODCACHE, GOCACHE) are left at their
# defaults, so a rebuild after changing a pin only recompiles what changed.
set -euo pipefail

# ---- pinned versions -------------------------------------------------------
KUBE_VERSION="v1.32.13"   # k8s.io/kubernetes (kube-apiserver, kubectl, the node's tools)
# The module proxy refuses k8s.io/endpointslice at the staging version ("403 Forbidden: This
# module version is not available"); kube-controller-manager and kube-proxy import it, and the
# previous patch release of that module is what they get instead.
ENDPOINTSLICE_VERSION="v0.32.12"
ETCD_VERSION="v3.5.35"    # go.etcd.io/etcd/server/v3 (kube 1.32 wants etcd >= 3.5.11)
HELM_VERSION="v3.22.0"    # helm.sh/helm/v3
COREDNS_VERSION="v1.14.7" # github.com/coredns/coredns (the node's cluster DNS)
# github.com/cloudnativelabs/kube-router/v2: only its network policy controller runs on the node
# (docs/deploy.md, "NetworkPolicies on the node"). The module proxy serves no later version.
KUBE_ROUTER_VERSION="v2.1.0"
# Bump when the build recipe (flags, layout) changes, to force a rebuild.
RECIPE_REV="1"
# ---------------------------------------------------------------------------

CACHE_ROOT="${CASQUE_CACHE:-$HOME/.cache/casque}"
KUBE_DIR="${CACHE_ROOT}/kube"
BIN_DIR="${KUBE_DIR}/bin"
STAMP_DIR="${BIN_DIR}/.stamps"
SRC_DIR="${KUBE_DIR}/src"
KUBE_TOOLS=(kube-apiserver kubectl kubelet kube-scheduler kube-controller-manager kube-proxy)
TOOLS=("${KUBE_TOOLS[@]}" etcd helm coredns kube-router)

FORCE=0
for arg in "$@"; do
  case "${arg}" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "install-kube-tools: unknown argument: ${arg}" >&2; exit 2 ;;
  esac
done

tool_version() {
  case "$1" in
    kube-router) echo "${KUBE_ROUTER_VERSION}" ;;
    kube-*|kubectl|kubelet) echo "${KUBE_VERSION}" ;;
    etcd) echo "${ETCD_VERSION}" ;;
    helm) echo "${HELM_VERSION}" ;;
    coredns) echo "${COREDNS_VERSION}" ;;
  esac
}

expected_stamp() {
  echo "$1 $(tool_version "$1") recipe=${RECIPE_REV}"
}

is_current() {
  local tool="$1"
  [[ -x "${BIN_DIR}/${tool}" && -f "${STAMP_DIR}/${tool}" ]] || return 1
  [[ "$(<"${STAMP_DIR}/${tool}")" == "$(expected_stamp "${tool}")" ]]
}

report() {
  local tool
  for tool in "${TOOLS[@]}"; do
    printf '%-15s %-9s %s\n' "${tool}" "$(tool_version "${tool}")" "${BIN_DIR}/${tool}"
  done
}

missing_tools() {
  local tool
  for tool in "${TOOLS[@]}"; do
    if [[ "${FORCE}" == 1 ]] || ! is_current "${tool}"; then
      echo "${tool}"
    fi
  done
}

# Fast path: nothing to do (no Go invocation, no lock).
if [[ -z "$(missing_tools)" ]]; then
  report
  exit 0
fi

mkdir -p "${BIN_DIR}" "${STAMP_DIR}" "${SRC_DIR}"

# Serialise concurrent runs (e.g. several test sessions on a fresh machine).
exec 9>"${KUBE_DIR}/.install.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi

# Another run may have finished the work while we waited for the lock.
mapfile -t TODO < <(missing_tools)
if [[ ${#TODO[@]} -eq 0 ]]; then
  report
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "install-kube-tools: the Go toolchain ('go') is required but not on PATH" >&2
  exit 1
fi

export CGO_ENABLED=0
export GOWORK=off
export GOFLAGS="-mod=mod"
# GOTOOLCHAIN is left alone: with the default 'auto', an older local Go fetches
# the toolchain a module asks for from the module proxy.

log() { echo "install-kube-tools: $*" >&2; }

wants() {
  local t
  for t in "${TODO[@]}"; do
    [[ "${t}" == "$1" ]] && return 0
  done
  return 1
}

# Directory of a downloaded module in the module cache.
module_dir() {
  local dir
  dir="$(go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
  if [[ -z "${dir}" || ! -d "${dir}" ]]; then
    log "could not download module $1"
    exit 1
  fi
  echo "${dir}"
}

# The 'go' directive of a module's go.mod (e.g. 1.23.0).
go_directive() {
  sed -n 's/^go \([0-9.]*\)[[:space:]]*$/\1/p' "$1/go.mod" | head -n1
}

# Write a throwaway main module into $1 with go directive $2; the rest of its go.mod
# (requires, replaces) is read from stdin. There is deliberately no `go mod tidy`:
# tidy also wants the modules used by the *tests* of every dependency, and some of
# those (e.g. k8s.io/cri-client) are not on every proxy. `go build -mod=mod` records
# exactly what the build needs, all of it pinned by the dependency's own go.mod.
write_module() {
  local dir="$1" godir="$2"
  rm -rf "${dir}"
  mkdir -p "${dir}"
  {
    echo "module casque.invalid/kubetools"
    echo
    echo "go ${godir}"
    echo
    echo "godebug default=go$(echo "${godir}" | cut -d. -f1,2)"
    echo
    cat
  } >"${dir}/go.mod"
}

# Run a freshly built tool and make sure it reports the pinned version.
check_version() {
  local name="$1" want out
  want="$(tool_version "${name}")"
  case "${name}" in
    etcd) out="$("${BIN_DIR}/etcd" --version)"; want="etcd Version: ${want#v}" ;;
    # It prints its version on stderr ("Running kube-router version v2.1.0, built on ...").
    kube-router) out="$("${BIN_DIR}/kube-router" --version 2>&1)"; want="version ${want}," ;;
    kube-*|kubelet) out="$("${BIN_DIR}/${name}" --version)" ;;
    kubectl) out="$("${BIN_DIR}/kubectl" version --client)" ;;
    helm) out="$("${BIN_DIR}/helm" version --short)" ;;
    coredns) out="$("${BIN_DIR}/coredns" -version)"; want="CoreDNS-${want#v}" ;;
  esac
  if [[ "${out}" != *"${want}"* ]]; then
    log "${name} does not report ${want}:"
    echo "${out}" >&2
    exit 1
  fi
}

# Build packages $3... in module dir $1 with extra ldflags $2 and install them.
build_into_bin() {
  local dir="$1" ldflags="$2"
  shift 2
  local out
  out="$(mktemp -d "${KUBE_DIR}/.build.XXXXXX")"
  (cd "${dir}" && go build -trimpath -ldflags "-s -w ${ldflags}" -o "${out}/" "$@")
  local pkg built name
  for pkg in "$@"; do
    case "${pkg}" in
      # etcd's main package; go names the binary after the element before /v3.
      go.etcd.io/etcd/server/v3) built="server" name="etcd" ;;
      *) built="${pkg##*/}" name="${pkg##*/}" ;;
    esac
    rm -f "${STAMP_DIR}/${name}"
    mv -f "${out}/${built}" "${BIN_DIR}/${name}"
    check_version "${name}"
    expected_stamp "${name}" >"${STAMP_DIR}/${name}"
  done
  rm -rf "${out}"
}

elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

# Leftovers of an interrupted build (we hold the lock, so nobody else is building).
rm -rf "${KUBE_DIR}"/.build.*

START_ALL="$(date +%s)"
log "building: ${TODO[*]} (go $(go env GOVERSION), cache ${KUBE_DIR})"

# ---- etcd ------------------------------------------------------------------
build_etcd() {
if wants etcd; then
  t0="$(date +%s)"
  etcd_src="$(module_dir "go.etcd.io/etcd/server/v3@${ETCD_VERSION}")"
  etcd_v2="v2.30${ETCD_VERSION#v3.}"   # client/v2 is versioned v2.305.x for etcd v3.5.x
  write_module "${SRC_DIR}/etcd" "$(go_directive "${etcd_src}")" <<EOF
require (
	go.etcd.io/etcd/api/v3 ${ETCD_VERSION}
	go.etcd.io/etcd/client/pkg/v3 ${ETCD_VERSION}
	go.etcd.io/etcd/client/v2 ${etcd_v2}
	go.etcd.io/etcd/client/v3 ${ETCD_VERSION}
	go.etcd.io/etcd/pkg/v3 ${ETCD_VERSION}
	go.etcd.io/etcd/raft/v3 ${ETCD_VERSION}
	go.etcd.io/etcd/server/v3 ${ETCD_VERSION}
)
EOF
  build_into_bin "${SRC_DIR}/etcd" "" "go.etcd.io/etcd/server/v3"
  log "etcd built in $(elapsed "${t0}")"
fi
}

# ---- kube-apiserver, kubectl and the node's tools ------------------------------
build_kube() {
kube_todo=()
for t in "${KUBE_TOOLS[@]}"; do
  wants "${t}" && kube_todo+=("${t}")
done
if [[ ${#kube_todo[@]} -gt 0 ]]; then
  t0="$(date +%s)"
  kube_src="$(module_dir "k8s.io/kubernetes@${KUBE_VERSION}")"
  staging_version="v0.${KUBE_VERSION#v1.}"   # v1.32.13 -> v0.32.13
  # Every k8s.io/* module that k8s.io/kubernetes replaces with ./staging/...
  mapfile -t staging < <(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' \
    "${kube_src}/go.mod")
  if [[ ${#staging[@]} -eq 0 ]]; then
    log "found no staging replacements in ${kube_src}/go.mod"
    exit 1
  fi
  pkgs=("${kube_todo[@]/#/k8s.io/kubernetes/cmd/}")
  {
    echo "require k8s.io/kubernetes ${KUBE_VERSION}"
    echo
    echo "replace ("
    for m in "${staging[@]}"; do
      if [[ "${m}" == k8s.io/endpointslice ]]; then
        echo "	${m} => ${m} ${ENDPOINTSLICE_VERSION}"
      else
        echo "	${m} => ${m} ${staging_version}"
      fi
    done
    echo ")"
  } | write_module "${SRC_DIR}/kubernetes" "$(go_directive "${kube_src}")"
  minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
  kube_ldflags=""
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    kube_ldflags+=" -X ${pkg}.gitVersion=${KUBE_VERSION}"
    kube_ldflags+=" -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
    kube_ldflags+=" -X ${pkg}.gitTreeState=clean"
  done
  build_into_bin "${SRC_DIR}/kubernetes" "${kube_ldflags}" "${pkgs[@]}"
  log "${pkgs[*]##*/} built in $(elapsed "${t0}")"
fi
}

# ---- helm --------------------------------------------------------------------
build_helm() {
if wants helm; then
  t0="$(date +%s)"
  helm_src="$(module_dir "helm.sh/helm/v3@${HELM_VERSION}")"
  write_module "${SRC_DIR}/helm" "$(go_directive "${helm_src}")" <<EOF
require helm.sh/helm/v3 ${HELM_VERSION}
EOF
  build_into_bin "${SRC_DIR}/helm" \
    "-X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
    "helm.sh/helm/v3/cmd/helm"
  log "helm built in $(elapsed "${t0}")"
fi
}

# ---- CoreDNS -------------------------------------------------------------------
# Its version is a constant in its source (coremain), so no -X flag is needed.
build_coredns() {
if wants coredns; then
  t0="$(date +%s)"
  coredns_src="$(module_dir "github.com/coredns/coredns@${COREDNS_VERSION}")"
  write_module "${SRC_DIR}/coredns" "$(go_directive "${coredns_src}")" <<EOF
require github.com/coredns/coredns ${COREDNS_VERSION}
EOF
  build_into_bin "${SRC_DIR}/coredns" "" "github.com/coredns/coredns"
  log "coredns built in $(elapsed "${t0}")"
fi
}

# ---- kube-router -----------------------------------------------------------------
# Its version is a variable set by ldflags (empty otherwise).
build_kube_router() {
if wants kube-router; then
  t0="$(date +%s)"
  kube_router_src="$(module_dir "github.com/cloudnativelabs/kube-router/v2@${KUBE_ROUTER_VERSION}")"
  write_module "${SRC_DIR}/kube-router" "$(go_directive "${kube_router_src}")" <<EOF
require github.com/cloudnativelabs/kube-router/v2 ${KUBE_ROUTER_VERSION}
EOF
  build_into_bin "${SRC_DIR}/kube-router" \
    "-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=${KUBE_ROUTER_VERSION}" \
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
  log "kube-router built in $(elapsed "${t0}")"
fi
}

# Two lanes at once: the Kubernetes components (over half of the time), and the other four
# tools one after the other. Each go build compiles on every core already; two at once
# overlap one's module downloads and single-threaded links with the other's compiling.
build_kube &
kube_lane=$!
( build_etcd; build_helm; build_coredns; build_kube_router ) &
other_lane=$!
failed=0
wait "${kube_lane}" || failed=1
wait "${other_lane}" || failed=1
if [[ "${failed}" != 0 ]]; then
  log "a build failed (its lines above say which)"
  exit 1
fi

log "done in $(elapsed "${START_ALL}")"
report
