#!/usr/bin/env bash
# Prepares the image tests (tests/integration/test_images.py), idempotently and cached:
#
# 1. podman and what it runs with, from Debian's packages: runc as the runtime (crun fails on
#    setrlimit on these machines), conmon, netavark and aardvark-dns with iptables for
#    networks, fuse-overlayfs, uidmap, catatonit; debootstrap for the base below.
# 2. /etc/containers/containers.conf: runc as the engine's runtime and default ulimits under
#    the host's hard limits (podman's default nofile of 1048576 is above them here, and the
#    runtime's setrlimit then fails). Only keys this script owns are written; a file with
#    other settings keeps them.
# 3. The base image localhost/casque-base:bookworm, for machines that reach no image registry:
#    Debian bookworm (minbase) with python3.11 and its venv module, from Debian's own
#    packages, plus this host's CA bundle (so pip inside a build trusts what the host trusts).
#    The root filesystem is kept as a tarball under ${CASQUE_CACHE:-~/.cache/casque}/images,
#    named by a hash of everything that goes into it; the image carries that hash as a label
#    and is imported again only when it differs.
# 4. The locked wheels the Dockerfiles install (scripts/locked-wheels.sh): the image tests
#    build with no network at all, from those wheels only.
#
#   bash scripts/install-podman.sh           # what is missing
#   bash scripts/install-podman.sh --force   # the base tarball and image anew
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE="bookworm"
MIRROR="${CASQUE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3.11,python3-venv,ca-certificates"
BASE_IMAGE="localhost/casque-base:bookworm"
# Bump when the recipe below changes, to force a new tarball.
RECIPE_REV="1"
CACHE_DIR="${CASQUE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/casque}/images"

FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "install-podman: unknown argument: $arg" >&2; exit 2 ;;
  esac
done
log() { echo "install-podman: $*" >&2; }
sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"

# ---- 1. packages -------------------------------------------------------------------------
need=()
for pair in podman:podman runc:runc conmon:conmon debootstrap:debootstrap iptables:iptables \
            fuse-overlayfs:fuse-overlayfs newuidmap:uidmap slirp4netns:slirp4netns catatonit:catatonit; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || [ -x "/usr/libexec/podman/${pair%%:*}" ] \
    || need+=("${pair#*:}")
done
for pkg in netavark aardvark-dns golang-github-containers-common; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]} (apt)"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# ---- 2. containers.conf --------------------------------------------------------------------
# 4096 each, or the hard limit when that is lower.
hard_nofile="$(ulimit -Hn)"; hard_nproc="$(ulimit -Hu)"
cap() { if [ "$2" = "unlimited" ] || [ "$2" -ge "$1" ]; then echo "$1"; else echo "$2"; fi; }
nofile="$(cap 4096 "$hard_nofile")"; nproc="$(cap 4096 "$hard_nproc")"
conf=/etc/containers/containers.conf
$sudo_cmd python3 - "$conf" "$nofile" "$nproc" <<'PY'
"""Set [containers] default_ulimits and [engine] runtime, leaving every other line alone."""
import sys
from pathlib import Path

path, nofile, nproc = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
wanted = {
    "containers": ("default_ulimits", f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]'),
    "engine": ("runtime", 'runtime = "runc"'),
}
lines = path.read_text().splitlines() if path.exists() else []
out: list[str] = []
section = None
done: set[str] = set()


def close(section: str | None) -> None:
    if section in wanted and section not in done:
        out.append(wanted[section][1])
        done.add(section)


skipping = False
for line in lines:
    stripped = line.strip()
    if skipping:
        # The rest of a multi-line array being replaced.
        skipping = "]" not in stripped
        continue
    if stripped.startswith("[") and not stripped.startswith("[["):
        close(section)
        section = stripped.strip("[]").strip()
        out.append(line)
        continue
    key = stripped.split("=", 1)[0].strip()
    if section in wanted and "=" in stripped and key == wanted[section][0] and not stripped.startswith("#"):
        if section not in done:
            out.append(wanted[section][1])
            done.add(section)
        skipping = "[" in stripped.split("=", 1)[1] and "]" not in stripped.split("=", 1)[1]
        continue
    out.append(line)
close(section)
for name, (_, setting) in wanted.items():
    if name not in done:
        out += ["", f"[{name}]", setting]
text = "\n".join(out).lstrip("\n") + "\n"
if not path.exists() or path.read_text() != text:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
PY

# ---- 3. the base image -----------------------------------------------------------------------
ca_bundle=/etc/ssl/certs/ca-certificates.crt
key="$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" "$RECIPE_REV" "$(dpkg-query -W -f '${Version}' debootstrap)" \
  "$(sha256sum "$ca_bundle" | cut -d' ' -f1)" | sha256sum | cut -c1-16)"
tarball="$CACHE_DIR/casque-base-$SUITE-$key.tar"
mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/.install.lock"
flock 9

if [ "$FORCE" = 1 ] || [ ! -f "$tarball" ]; then
  t0=$(date +%s)
  root="$(mktemp -d "$CACHE_DIR/.root.XXXXXX")"
  trap '$sudo_cmd rm -rf "$root"' EXIT
  log "debootstrap $SUITE ($PACKAGES) from $MIRROR"
  $sudo_cmd debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >"$CACHE_DIR/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE_DIR/debootstrap.log" >&2; exit 1; }
  $sudo_cmd cp "$ca_bundle" "$root/etc/ssl/certs/ca-certificates.crt"
  # What an image does not need: downloaded packages, package lists, caches, logs.
  $sudo_cmd rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/* \
    "$root"/var/cache/ldconfig/aux-cache
  $sudo_cmd tar -C "$root" --numeric-owner --sort=name -cf "$tarball.partial" .
  mv "$tarball.partial" "$tarball"
  $sudo_cmd rm -rf "$root"
  trap - EXIT
  find "$CACHE_DIR" -maxdepth 1 -name "casque-base-$SUITE-*.tar" ! -name "$(basename "$tarball")" -delete
  log "base root filesystem in $(( $(date +%s) - t0 ))s: $tarball"
fi

have="$(podman image inspect --format '{{ index .Labels "casque.base.key" }}' "$BASE_IMAGE" 2>/dev/null || true)"
if [ "$FORCE" = 1 ] || [ "$have" != "$key" ]; then
  # Debian's python3 is /usr/bin/python3; the variables are the official image's, so a build
  # behaves alike on either base. REQUESTS_CA_BUNDLE and PIP_CERT point at the bundle above.
  podman import --quiet \
    --change "LABEL casque.base.key=$key" \
    --change "ENV LANG=C.UTF-8" \
    --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
    --change 'CMD ["python3"]' \
    "$tarball" "$BASE_IMAGE" >/dev/null
  log "imported $BASE_IMAGE ($key)"
fi
# ---- 4. the locked wheels, for builds without a network ------------------------------------
bash scripts/locked-wheels.sh
echo "podman $(podman --version | cut -d' ' -f3) (runtime $(podman info --format '{{.Host.OCIRuntime.Name}}')), base $BASE_IMAGE ($key)"
