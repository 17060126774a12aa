#!/usr/bin/env bash
# Create .venv with a CPU torch and nbaccel (editable) plus the notebook and test extras.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch is pinned for the dev/test environment only: 2.13.0 is the local CPU build here;
# an unpinned torch would pull several GB of CUDA packages. nbaccel itself accepts torch>=2.4.
TORCH_SPEC=${NBACCEL_TORCH_SPEC:-torch==2.13.0}
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[notebook,test]"
# DeepSpeed (the optional `deepspeed` extra; tests of strategy="deepspeed"): an sdist whose build
# imports torch, hence --no-build-isolation after torch; pip keeps the built wheel in its cache.
# Only when missing (measured on a fresh venv: see README, "DeepSpeed").
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('deepspeed') is None)"; then
  .venv/bin/python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
fi
# Ray (the optional `ray` extra; cluster="ray" and tests/cluster): only when missing.
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('ray') is None)"; then
  .venv/bin/python -m pip install -q "ray[default]==2.60.0"
fi
