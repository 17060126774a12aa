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
  # No --compile-bytecode (uv's default, unlike pip): compiling every file of .venv took 33 s
  # of the set-up's wall and 61 CPU-s (26,725 files; measured), where a run imports a part of
  # them and Python writes those .pyc files at their first import. That needs
  # PYTHONDONTWRITEBYTECODE unset (this machine and CI set it: every process then compiles
  # every module it imports, each time): scripts/test.sh and scripts/demo.sh unset it.
  "$UV_BIN" pip install -q --python "$python" "$@"
}
