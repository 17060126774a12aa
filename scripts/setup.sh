#!/usr/bin/env bash
# Create .venv with a CPU torch and nbaccel (editable) plus the notebook, test and docs extras.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/editable_lock.sh
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch is pinned for the dev/test environment only: 2.13.0 is the local CPU build here;
# an unpinned torch would pull several GB of CUDA packages. nbaccel itself accepts torch>=2.4.
TORCH_SPEC=${NBACCEL_TORCH_SPEC:-torch==2.13.0}
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "$TORCH_SPEC"
# docs: the documentation site (bash scripts/docs.sh build, tests/docs): MkDocs, Material, mkdocstrings;
# ray: cluster="ray" and tests/cluster. One pip call, one resolution.
editable_turn .venv/bin/python -m pip install -q -e ".[notebook,test,docs,ray]"
# DeepSpeed (the optional `deepspeed` extra; tests of strategy="deepspeed"): an sdist whose build
# imports torch, hence --no-build-isolation after torch; pip keeps the built wheel in its cache.
# Only when missing (measured on a fresh venv: see README, "DeepSpeed").
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('deepspeed') is None)"; then
  .venv/bin/python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
fi
