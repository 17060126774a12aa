#!/usr/bin/env bash
# Set everything up, then run the quickstart: a real IPython kernel launches 2 CPU workers.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes the .pyc files of nbaccel's own modules (an editable install: the set-up
# compiles the venv's only); with PYTHONDONTWRITEBYTECODE set, each process would compile them.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
.venv/bin/python scripts/demo.py
