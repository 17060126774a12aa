#!/usr/bin/env bash
# Install what the browser test (pytest -m browser) needs, idempotently:
#   - Debian's chromium at /usr/bin/chromium (Playwright never downloads a browser of its own);
#   - playwright, jupyterlab>=4 and notebook>=7 (the classic Notebook UI) into .venv
#     (the `browser` extra in setup.cfg).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/editable_lock.sh
source scripts/uv_lib.sh
if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh
fi
# The pip package only ships the driver; browsers come from `playwright install`, never run here.
uv_ready
PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 editable_turn uv_install .venv/bin/python -e ".[browser]"
/usr/bin/chromium --version
