#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check nbaccel tests
.venv/bin/ruff format --check nbaccel tests
.venv/bin/mypy nbaccel
.venv/bin/python -m pytest "$@"
