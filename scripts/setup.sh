#!/usr/bin/env bash
# Create .venv with a CPU torch and nbaccel (editable) plus the notebook, test and docs extras.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/editable_lock.sh
source scripts/uv_lib.sh
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
uv_ready
# torch is pinned for the dev/test environment only: 2.13.0 is the local CPU build here;
# an unpinned torch would pull several GB of CUDA packages. nbaccel itself accepts torch>=2.4.
TORCH_SPEC=${NBACCEL_TORCH_SPEC:-torch==2.13.0}
uv_install .venv/bin/python "$TORCH_SPEC"
# docs: the documentation site (bash scripts/docs.sh build, tests/docs): MkDocs, Material, mkdocstrings;
# ray: cluster="ray" and tests/cluster; storage: checkpoints on object storage (fsspec, s3fs).
# One install, one resolution.
editable_turn uv_install .venv/bin/python -e ".[notebook,test,docs,ray,storage]"
# DeepSpeed (the optional `deepspeed` extra; tests of strategy="deepspeed"): an sdist whose build
# imports torch, hence --no-build-isolation after torch (its build needs setuptools and wheel
# from the venv); uv keeps the built wheel in its cache. Only when missing (measured on a fresh
# venv: see README, "DeepSpeed").
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('deepspeed') is None)"; then
  uv_install .venv/bin/python setuptools wheel
  uv_install .venv/bin/python --no-build-isolation "deepspeed==0.19.8"
fi
