#!/usr/bin/env bash
# Set everything up, then run the quickstart: a real IPython kernel launches 2 CPU workers.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes the .pyc files of what it imports (the set-up compiles none: scripts/uv_lib.sh);
# with PYTHONDONTWRITEBYTECODE set, the kernel and each worker would compile torch every time.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
.venv/bin/python scripts/demo.py
