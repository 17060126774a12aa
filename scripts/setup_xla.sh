#!/usr/bin/env bash
# Create .xla-venv: torch==2.9.0 + torch_xla==2.9.0 + nbaccel (editable), for the tests marked
# `xla` (tests/launch/test_xla.py runs tests/xla_scenarios.py there with PJRT_DEVICE=CPU).
#
# Cheap on purpose. PyPI's Linux x86_64 torch wheel is the CUDA build and pulls ~2.8 GB of
# nvidia-* wheels (about 7 GB installed); the XLA tests run on the CPU and never call CUDA.
# So: torch and torch_xla are installed with --no-deps plus only their pure-Python deps, and
# scripts/cuda_stubs.py builds tiny stand-ins for the NVIDIA libraries torch links
# against (torch.cuda.is_available() is then False). When that is not possible (no C
# compiler) or torch still does not import, the real NVIDIA wheels are installed instead.
# NBACCEL_XLA_FULL_TORCH=1 forces that path.
#
# Idempotent: when .xla-venv already imports torch_xla, this checkout's nbaccel and its
# requirements, it only prints so.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/editable_lock.sh
source scripts/uv_lib.sh
PY=${PYTHON:-python3}
VENV=.xla-venv
TORCH_VERSION=2.9.0
VPY="$VENV/bin/python"

# nbaccel's own requirements, minus torch, from setup.cfg (the single source of truth).
mapfile -t NBACCEL_DEPS < <("$PY" - <<'PYEOF'
import configparser, re
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
for req in cfg["options"]["install_requires"].split("\n"):
    req = req.strip()
    if req and re.split(r"[<>=!~ ;\[]", req)[0].lower() != "torch":
        print(req)
PYEOF
)

check() {
  # Imports what the xla tests need without touching CUDA, checks that nbaccel's
  # requirements are installed (setup.cfg may have gained one), prints the versions.
  PJRT_DEVICE=CPU "$VPY" - "$PWD" "${NBACCEL_DEPS[@]}" <<'PYEOF'
import importlib.metadata
import re
import sys
from pathlib import Path

import torch
import torch_xla
import torch_xla.runtime as xr
import nbaccel

root = Path(sys.argv[1]).resolve()
assert Path(nbaccel.__file__).resolve().is_relative_to(root), nbaccel.__file__
assert torch.__version__.split("+")[0] == torch_xla.__version__.split("+")[0]
for req in sys.argv[2:]:
    importlib.metadata.version(re.split(r"[<>=!~ ;\[]", req)[0])  # raises if missing
print(f"{sys.prefix}: torch {torch.__version__}, torch_xla {torch_xla.__version__}, "
      f"cuda available: {torch.cuda.is_available()}, PJRT device: {xr.device_type()}")
PYEOF
}

if [ -x "$VPY" ] && check 2>/dev/null; then
  exit 0
fi

if [ ! -x "$VPY" ]; then
  "$PY" -m venv "$VENV"
fi
uv_ready

# One --no-deps install (uv keeps the two big wheels, 980 MB, in its cache: re-creating the
# environment on the same machine downloads nothing): torch/torch_xla, their pure-Python
# requirements (torch: filelock, typing-extensions, sympy, networkx, jinja2, fsspec;
# torch_xla: absl-py, numpy, pyyaml, requests) with theirs and nbaccel's; then nbaccel itself
# (editable, in turn).
uv_install "$VPY" --no-deps "torch==$TORCH_VERSION" "torch_xla==$TORCH_VERSION" \
  filelock "typing-extensions>=4.10" "sympy>=1.13.3" mpmath "networkx>=2.5.1" jinja2 markupsafe \
  "fsspec>=0.8.5" absl-py numpy pyyaml requests charset-normalizer idna urllib3 certifi \
  "${NBACCEL_DEPS[@]}" dill
editable_turn uv_install "$VPY" --no-deps -e .

TORCH_LIB=$("$VPY" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0], "lib"))')
if [ "${NBACCEL_XLA_FULL_TORCH:-0}" != "1" ] && "$VPY" scripts/cuda_stubs.py "$TORCH_LIB" && check; then
  exit 0
fi

echo "setup_xla.sh: installing torch's NVIDIA dependencies (about 2.8 GB) instead of stubs" >&2
"$VPY" scripts/cuda_stubs.py "$TORCH_LIB" --remove
uv_install "$VPY" "torch==$TORCH_VERSION" "torch_xla==$TORCH_VERSION"
check
