# Helpers for the hosted-notebook stacks (scripts/stacks.env), sourced by setup_stack.sh,
# test_stacks.sh and stack_run.sh.
#
# A stack is a Debian root (debootstrap, minbase) in $STACKS_DIR/<suite> with the newer Python
# that Debian release packages, and one virtual environment per stack in it at /venvs/<name>.
# The roots live in nbaccel's cache folder, shared by every checkout on the machine (a fresh
# clone, as CI makes, finds them built): the checkout is mounted at /nbaccel and the venvs'
# nbaccel is installed in editable mode from there, so a root serves any checkout.
# Commands run in it through `stack_exec ROOT CMD...`: a private mount namespace (unshare; the
# mounts vanish with the command) with /proc, /dev, /sys, this checkout at /nbaccel and pip's
# cache at /root/.cache/pip, then chroot. Needs root (CI and the dev machines run as root).
# shellcheck shell=bash

STACKS_DIR=${NBACCEL_STACKS_DIR:-$HOME/.cache/nbaccel/stacks}
DEB_CACHE=${NBACCEL_DEB_CACHE:-$HOME/.cache/nbaccel/debs}
PIP_CACHE=${NBACCEL_PIP_CACHE:-$HOME/.cache/pip} # seen as /root/.cache/pip inside a root
DEBIAN_MIRROR=${NBACCEL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# shellcheck source=stacks.env
source "$(dirname "${BASH_SOURCE[0]}")/stacks.env"

stack_var() { # stack_var NAME FIELD -> the value of STACK_<NAME>_<FIELD>
  local var="STACK_$1_$2"
  printf '%s' "${!var-}"
}

stack_root_dir() { printf '%s/%s' "$STACKS_DIR" "$(stack_var "$1" SUITE)"; }

# The environment a command sees inside the root: a clean one, plus what tests need.
_stack_env() {
  local keep=(CI NBACCEL_REQUIRE_ALL OMP_NUM_THREADS PJRT_DEVICE PYTEST_ADDOPTS TERM)
  printf '%s\n' HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=180 PYTHONDONTWRITEBYTECODE=1 NBACCEL_STACK_ROOT="$1"
  local name
  for name in "${keep[@]}"; do
    if [ -n "${!name+x}" ]; then printf '%s=%s\n' "$name" "${!name}"; fi
  done
}

stack_exec() { # stack_exec ROOT [VAR=VALUE ...] CMD ARGS...: run CMD in the root, cwd /nbaccel
  local root=$1
  shift
  local -a env
  mapfile -t env < <(_stack_env "$root")
  while [ "$#" -gt 0 ] && [[ $1 == *=* ]] && [[ $1 != /* ]]; do
    env+=("$1")
    shift
  done
  mkdir -p "$root/nbaccel" "$root/root/.cache/pip" "$PIP_CACHE"
  # The host's CA bundle and resolver: pip inside reaches PyPI the way the host's pip does.
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  unshare --mount --fork --kill-child --propagation private \
    /bin/bash -c '
      set -e
      root=$1; src=$2; pipcache=$3; shift 3
      mount -t proc proc "$root/proc"
      mount --rbind /dev "$root/dev"
      mount --rbind /sys "$root/sys"
      mount --bind "$src" "$root/nbaccel"
      mount --bind "$pipcache" "$root/root/.cache/pip"
      exec chroot "$root" /usr/bin/env -i "$@"
    ' stack_exec "$root" "$PWD" "$PIP_CACHE" "${env[@]}" \
    /bin/sh -c 'cd /nbaccel && exec "$@"' sh "$@"
}

stack_make_root() { # stack_make_root NAME: debootstrap the stack's Debian release (once)
  local name=$1 suite python root
  suite=$(stack_var "$name" SUITE)
  python=$(stack_var "$name" PYTHON)
  root=$(stack_root_dir "$name")
  local packages="$python,$python-venv,lib$python,ca-certificates,gcc,libc6-dev,binutils"
  if [ "$(cat "$root/.nbaccel-root" 2>/dev/null)" = "$packages" ]; then
    return 0
  fi
  if ! command -v debootstrap >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap \
      >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; }
  fi
  local script=/usr/share/debootstrap/scripts/$suite
  [ -e "$script" ] || script=/usr/share/debootstrap/scripts/sid # newer than this debootstrap
  rm -rf "$root"
  mkdir -p "$STACKS_DIR" "$DEB_CACHE/$suite"
  # lib$python: torch_xla links libpython; gcc + binutils: scripts/cuda_stubs.py builds its
  # stub libraries inside the root.
  debootstrap --variant=minbase --cache-dir="$DEB_CACHE/$suite" --include="$packages" \
    "$suite" "$root" "$DEBIAN_MIRROR" "$script" >"$STACKS_DIR/debootstrap-$suite.log" 2>&1 || {
    tail -n 20 "$STACKS_DIR/debootstrap-$suite.log" >&2
    return 1
  }
  rm -rf "$root/var/cache/apt/archives"/*.deb
  echo "$packages" >"$root/.nbaccel-root" # what it was made with: a change remakes it
}
