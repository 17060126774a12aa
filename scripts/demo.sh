#!/usr/bin/env bash
# Set everything up, then run the quickstart: a real IPython kernel launches 2 CPU workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/demo.py
