# Sourced by the set-up scripts: they install with uv (`uv pip install`), which resolves the
# same requirements as pip at a tenth of its CPU time (measured on the README's machine: .venv's
# requirements in 8 s against pip's 119 s) and links its files from one cache shared by every
# venv here (.venv, .xla-venv, the torch matrix's).
#   uv_ready: .tools/uv/bin/uv (pinned; pip installs that one wheel once) and UV_* from pip's
#             configuration (scripts/uv_env.py: the machine's local wheels, indexes and caps)
#   uv_install PYTHON ARGS...: `uv pip install ARGS` into PYTHON's environment
UV_VERSION=0.13.9
UV_CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UV_BIN=$UV_CHECKOUT/.tools/uv/bin/uv

uv_ready() {
  local root=$UV_CHECKOUT
  (
    flock 8  # the set-ups beside each other ask at once (scripts/test.sh)
    if ! { [ -x "$UV_BIN" ] && "$UV_BIN" --version | grep -q " $UV_VERSION\b"; }; then
      rm -rf "$root/.tools/uv"
      "${PYTHON:-python3}" -m pip install -qq --disable-pip-version-check --root-user-action=ignore \
        --target "$root/.tools/uv" "uv==$UV_VERSION"
    fi
  ) 8>"$root/.tools.lock"
  eval "$("${PYTHON:-python3}" "$root/scripts/uv_env.py")"
}

uv_install() {
  local python=$1
  shift
  # --compile-bytecode: as pip does. Where PYTHONDONTWRITEBYTECODE is set (this machine, CI)
  # nothing else would write the .pyc files. Without it (tried: uv's default) the set-up took
  # 27 s instead of 47, but the main run compiled what it imported in both xdist workers and
  # every kernel at once: the whole run was no shorter (942 s against 889-929 s).
  "$UV_BIN" pip install -q --compile-bytecode --python "$python" "$@"
}
