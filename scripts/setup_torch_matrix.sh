#!/usr/bin/env bash
# Create .torch-venvs/<version>/ for every torch in the test matrix (scripts/torch_matrix.env),
# each with that torch, nbaccel's requirements, the notebook extras and the test
# tools; nbaccel itself is this checkout (installed editable, no dependencies resolved).
# scripts/test_torch_matrix.sh runs the launcher, runtime and kernel tests in each of them.
#
# Usage: bash scripts/setup_torch_matrix.sh [VERSION ...]
#
# The matrix is the OLDEST torch setup.cfg claims (its `torch>=X` floor, newest patch) and the
# NEWEST release; the pinned dev torch (.venv, scripts/setup.sh) runs the whole suite.
# PyPI has only CUDA builds of these for Linux x86_64 (no `+cpu` wheels there; the CPU index
# is not reachable), which pull ~2.8 GB of nvidia-* wheels. So, as scripts/setup_xla.sh does:
# the torch wheel is installed with --no-deps plus the requirements its own metadata lists,
# minus nvidia-* and triton (GPU-only), and scripts/cuda_stubs.py builds tiny stand-ins for the
# NVIDIA libraries torch links against (torch.cuda.is_available() is then False). When that
# fails (no C compiler) the real NVIDIA wheels are installed instead.
#
# Idempotent and cheap to re-run: uv (scripts/uv_lib.sh) keeps the torch wheels in its
# cache, and a venv that
# already imports its torch, this checkout's nbaccel and every requirement is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/editable_lock.sh
source scripts/uv_lib.sh
PY=${PYTHON:-python3}
# Some machines cap pip at the torch they keep on disk (a global `constraint = ...` in
# /etc/pip.conf, e.g. torch<=2.14.1), which makes the NEWEST release of the matrix
# uninstallable ("ResolutionImpossible"). The matrix venvs install an exact torch wheel on
# purpose, without its CUDA wheels, so this script alone asks pip (and so uv: uv_env.py)
# for no constraints.
export PIP_CONSTRAINT=/dev/null
uv_ready
source scripts/torch_matrix.env  # TORCH_MATRIX: the versions, oldest first
if [ "$#" -gt 0 ]; then VERSIONS=("$@"); else read -r -a VERSIONS <<<"$TORCH_MATRIX"; fi

# What the launcher/runtime/kernel tests need besides torch: nbaccel's own requirements and
# its notebook extra from setup.cfg (the single source of truth), and the test tools those
# tests use (not ruff/mypy/tensorboard/playwright: those run in .venv only).
mapfile -t DEPS < <("$PY" - <<'PYEOF'
import configparser, re
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
reqs = cfg["options"]["install_requires"].split("\n")
reqs += cfg["options.extras_require"]["notebook"].split("\n")
for req in reqs:
    req = req.strip()
    if req and re.split(r"[<>=!~ ;\[]", req)[0].lower() != "torch":
        print(req)
PYEOF
)
TEST_DEPS=("pytest>=8" "pytest-timeout>=2.3" "nbclient>=0.10" "jupyter_client>=8" "pexpect>=4.8")

check() {
  # Imports torch without touching CUDA, checks this checkout's nbaccel and every requirement
  # (setup.cfg may have gained one) and prints the versions.
  "$1" - "$PWD" "$2" "${DEPS[@]}" "${TEST_DEPS[@]}" <<'PYEOF'
import importlib.metadata
import re
import sys
from pathlib import Path

import torch
import torch.distributed
import nbaccel

root, want = Path(sys.argv[1]).resolve(), sys.argv[2]
assert Path(nbaccel.__file__).resolve().is_relative_to(root), nbaccel.__file__
assert torch.__version__.split("+")[0] == want, (torch.__version__, want)
for req in sys.argv[3:]:
    importlib.metadata.version(re.split(r"[<>=!~ ;\[]", req)[0])  # raises if missing
print(f"{sys.prefix}: torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
PYEOF
}

setup_one() {
  local version=$1 venv=.torch-venvs/$1
  local vpy=$venv/bin/python
  if [ -x "$vpy" ] && check "$vpy" "$version" 2>/dev/null; then
    return 0
  fi
  [ -x "$vpy" ] || "$PY" -m venv "$venv"
  uv_install "$vpy" --no-deps "torch==$version"
  # torch's own requirements (with their markers), read from its metadata, minus the GPU ones.
  local torch_deps
  mapfile -t torch_deps < <("$vpy" - <<'PYEOF'
import importlib.metadata
for req in importlib.metadata.requires("torch") or []:
    if "extra ==" in req:
        continue
    if req.lower().startswith(("nvidia-", "triton", "cuda-")):
        continue
    print(req)
PYEOF
)
  uv_install "$vpy" "${torch_deps[@]}" "${DEPS[@]}" "${TEST_DEPS[@]}"
  editable_turn uv_install "$vpy" --no-deps -e .
  local torch_lib
  torch_lib=$("$vpy" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0], "lib"))')
  if [ "${NBACCEL_MATRIX_FULL_TORCH:-0}" != "1" ] && "$vpy" scripts/cuda_stubs.py "$torch_lib" \
    && check "$vpy" "$version"; then
    return 0
  fi
  echo "setup_torch_matrix.sh: torch $version: installing its NVIDIA dependencies instead of stubs" >&2
  "$vpy" scripts/cuda_stubs.py "$torch_lib" --remove
  uv_install "$vpy" "torch==$version"
  check "$vpy" "$version"
}

for version in "${VERSIONS[@]}"; do
  setup_one "$version"
done
