#!/usr/bin/env bash
# The documentation site (MkDocs + Material + mkdocstrings; docs/contributing.md says why).
#   bash scripts/docs.sh build       strict build into site/: a broken link or anchor, a missing
#                                    reference or a page left out of the nav fails it
#   bash scripts/docs.sh serve       the same site on http://127.0.0.1:8000, rebuilt on each edit
#   bash scripts/docs.sh notebooks   re-execute notebooks/*.ipynb in a real kernel into
#                                    docs/notebooks/ (the executed copies the site renders)
# Installs the `docs` extra into .venv first when it is missing (idempotently).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh
fi
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python, mkdocs_jupyter" 2>/dev/null; then
  .venv/bin/python -m pip install -q -e ".[docs]"
fi
# the hooks import nbaccel and scripts/docs_hooks.py from the repository root
export NO_MKDOCS_2_WARNING=1  # Material's banner about its end of life, printed on every build
export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
case "${1:-build}" in
  build) shift || true; exec .venv/bin/python -m mkdocs build --strict --clean "$@" ;;
  serve) shift; exec .venv/bin/python -m mkdocs serve --strict "$@" ;;
  notebooks) shift; exec .venv/bin/python scripts/docs_notebooks.py "$@" ;;
  *) echo "usage: bash scripts/docs.sh [build|serve|notebooks] [mkdocs options]" >&2; exit 2 ;;
esac
