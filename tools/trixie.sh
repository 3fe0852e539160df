#!/usr/bin/env bash
# Runs the README's set-up and test commands against the oldest supported
# PyTorch, 2.6, on this machine: Debian trixie's LibTorch 2.6.0 and
# python3-torch, inside a Debian trixie root made with debootstrap from the
# mirror apt already uses (no GPU libraries to download, unlike PyPI's 2.6
# wheels, and Debian's own Gloo headers match its LibTorch). The root lives in
# an ignored folder (.roots/trixie, or $CONTRAX_TRIXIE_ROOT) and is reused by
# later runs; the checkout is bind-mounted into it at /contrax and built in its
# own folder (build-trixie), so the build in build/ is left alone.
#
#   bash tools/trixie.sh                 # set-up + every test on LibTorch 2.6
#   bash tools/trixie.sh -- build-trixie/contrax verify --nproc 4   # any command
#   bash tools/trixie.sh --shell         # an interactive shell in the root
#
# Inside the root, the README's commands install what they need with apt-get
# (CONTRAX_TORCH=system: Debian's LibTorch instead of a PyPI venv): this
# script only makes the root and mounts /proc, /dev and the checkout while it
# runs (unmounted again on any exit).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

shell=0
cmd=()
while (($#)); do
  case "$1" in
    --shell) shell=1 ;;
    --) shift; cmd=("$@"); break ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "tools/trixie.sh: unknown argument '$1' (expected --shell, or -- COMMAND...)" >&2; exit 2 ;;
  esac
  shift
done

[ "$(id -u)" -eq 0 ] || { echo "tools/trixie.sh: must run as root (debootstrap, chroot and mount need it)" >&2; exit 2; }

ROOT=${CONTRAX_TRIXIE_ROOT:-$REPO/.roots/trixie}
BUILD=build-trixie

# The mirror apt uses here (deb822 sources first, then the one-line format).
mirror() {
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

# One run per root at a time: a second one would stack its mounts on the
# first's and unmount them under it when it ends.
mkdir -p "$(dirname "$ROOT")"
exec 9>"$ROOT.lock"
if ! flock -n 9; then
  echo "tools/trixie.sh: another run is using $ROOT; waiting for it to finish" >&2
  flock 9
fi

MOUNTS=()
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    umount -l "${MOUNTS[i]}" 2>/dev/null || true
  done
  # And what the commands mounted inside the root (the tests' `ip netns add`
  # bind-mounts /run/netns onto itself), deepest first: a mount left behind
  # would keep the root from being deleted.
  local m
  awk -v root="$ROOT/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

do_mount() {  # do_mount TARGET ARGS...
  local target=$1
  shift
  mkdir -p "$target"
  mount "$@" "$target"
  MOUNTS+=("$target")
}

if [ ! -f "$ROOT/.contrax-root-ready" ]; then
  command -v debootstrap >/dev/null || {
    echo "tools/trixie.sh: installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  }
  components=main
  MIRROR=$(mirror)
  echo "tools/trixie.sh: debootstrap trixie ($components) from $MIRROR into $ROOT"
  rm -rf "$ROOT"
  mkdir -p "$(dirname "$ROOT")"
  start=$(date +%s)
  debootstrap --variant=minbase --components="$components" trixie "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 || {
    echo "tools/trixie.sh: debootstrap failed; the last lines of $ROOT.debootstrap.log:" >&2
    tail -n 20 "$ROOT.debootstrap.log" >&2
    exit 1
  }
  # apt inside the root: the same mirror, the components asked for, no recommends.
  echo "deb $MIRROR trixie ${components//,/ }" >"$ROOT/etc/apt/sources.list"
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$ROOT/etc/apt/apt.conf.d/90contrax"
  touch "$ROOT/.contrax-root-ready"
  echo "tools/trixie.sh: root ready in $(($(date +%s) - start)) s"
fi
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
# debootstrap writes no /etc/hosts, and without one "localhost" does not
# resolve: torchrun --standalone's rendezvous (localhost:0) then fails.
[ -s "$ROOT/etc/hosts" ] || printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n' >"$ROOT/etc/hosts"

do_mount "$ROOT/proc" -t proc proc
do_mount "$ROOT/dev" --bind /dev
do_mount "$ROOT/dev/pts" --bind /dev/pts
do_mount "$ROOT/sys" --bind /sys
do_mount "$ROOT/contrax" --bind "$REPO"

run_in_root() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    CONTRAX_BUILD_DIR="$BUILD" CONTRAX_TORCH=system CI="${CI:-}" \
    bash -c 'cd /contrax && "$@"' bash "$@"
}

if ((shell)); then
  run_in_root bash -i
elif ((${#cmd[@]})); then
  # Set-up first (installs and builds incrementally), then the command.
  run_in_root bash tools/setup.sh
  run_in_root "${cmd[@]}"
else
  run_in_root bash tools/test.sh
fi
