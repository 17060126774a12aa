#!/usr/bin/env bash
# Create bench/.peers-venv: the benchmark's own environment with the peers
# (Hugging Face accelerate, Lightning) next to nbaccel, all on ONE torch build.
#
# The peers are never dependencies of nbaccel. torch is pinned in the same pip
# command as the peers so that pip cannot swap in another torch to satisfy them
# (an unpinned resolve may pull a CUDA build of several GB).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=bench/.peers-venv
TORCH_SPEC=${NBACCEL_TORCH_SPEC:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
# (the grep drops pip's warnings about configured index folders that do not exist)
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC" -e ".[notebook]" \
  accelerate lightning jupyter_client psutil \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# Prove the pin held: the peers must run on exactly the torch nbaccel runs on.
"$VENV/bin/python" - "$TORCH_SPEC" <<'PY'
import sys
import torch, accelerate, lightning, nbaccel  # noqa: F401
want = sys.argv[1].split("==", 1)[-1]
if not torch.__version__.split("+")[0] == want.split("+")[0]:
    sys.exit(f"peers venv has torch {torch.__version__}, expected {want}")
print(f"bench/.peers-venv ready: torch {torch.__version__}, accelerate {accelerate.__version__}, "
      f"lightning {lightning.__version__}")
PY
