#!/usr/bin/env bash
# Build the hosted-notebook stacks of scripts/stacks.env (default: all of them), e.g.
#   bash scripts/setup_stack.sh colab
# Each is a virtual environment /venvs/<name> inside a Debian root made with debootstrap in
# ~/.cache/nbaccel/stacks/<suite> (NBACCEL_STACKS_DIR; scripts/stack_lib.sh), holding that
# release's Python, the stack's torch (PyPI's
# CUDA wheel installed with --no-deps; scripts/cuda_stubs.py stands in for the NVIDIA
# libraries, so torch.cuda.is_available() is False), torch_xla where the stack has it, the
# stack's notebook packages (ipywidgets, ipykernel, ...), nbaccel's requirements from
# setup.cfg, the test runner, and this checkout's nbaccel (editable, mounted at /nbaccel).
#
# Idempotent and cached: a stack that already imports what it should is left as it is (a
# re-run takes seconds); Debian's packages are cached in ~/.cache/nbaccel/debs, the torch and
# torch_xla wheels in ~/.cache/pip/nbaccel-torch-wheels; uv installs them (scripts/uv_lib.sh).
# Prints one line per stack with its versions; exit status 1 when one could not be built.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/stack_lib.sh
source scripts/editable_lock.sh
source scripts/uv_lib.sh
if [ "$#" -gt 0 ]; then NAMES=("$@"); else read -r -a NAMES <<<"$STACKS"; fi

# nbaccel's requirements minus torch and ipywidgets (each stack names its own), from setup.cfg.
mapfile -t DEPS < <(python3 - <<'PYEOF'
import configparser, re
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
reqs = cfg["options"]["install_requires"].split("\n")
reqs += cfg["options.extras_require"]["notebook"].split("\n")
for req in reqs:
    req = req.strip()
    if req and re.split(r"[<>=!~ ;\[]", req)[0].lower() not in ("torch", "ipywidgets", "ipykernel"):
        print(req)
PYEOF
)
TEST_DEPS=("pytest>=8" "pytest-timeout>=2.3" "nbclient>=0.10" "jupyter_client>=7" "pexpect>=4.8")

check() { # check NAME: the stack's venv imports what it should; prints its versions
  local name=$1 root
  root=$(stack_root_dir "$name")
  [ -f "$root/venvs/$name/pyvenv.cfg" ] || return 1  # bin/python links into the root
  stack_exec "$root" PJRT_DEVICE=CPU "/venvs/$name/bin/python" - "$name" \
    "$(stack_var "$name" TORCH)" "$(stack_var "$name" XLA)" \
    "${DEPS[@]}" "${TEST_DEPS[@]}" $(stack_var "$name" PIP) <<'PYEOF'
import importlib.metadata
import platform
import re
import sys
from pathlib import Path

import torch
import torch.distributed
import nbaccel

name, want_torch, want_xla = sys.argv[1:4]
assert Path(nbaccel.__file__).resolve().is_relative_to("/nbaccel"), nbaccel.__file__
assert torch.__version__.split("+")[0] == want_torch, (torch.__version__, want_torch)
assert not torch.cuda.is_available()
found = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
if want_xla:
    import torch_xla

    assert torch_xla.__version__.split("+")[0] == want_xla, torch_xla.__version__
    found.append(f"torch_xla {torch_xla.__version__}")
for req in sys.argv[4:]:
    dist, pin = re.split(r"[<>=!~ ;\[]", req)[0], re.search(r"==(\S+)", req)
    version = importlib.metadata.version(dist)  # raises if missing
    if pin:
        assert version == pin.group(1), (dist, version, pin.group(1))
    if dist.lower() in ("ipywidgets", "ipykernel", "ipython", "jupyter_client", "notebook"):
        found.append(f"{dist} {version}")
print(f"stack {name}: " + ", ".join(found))
PYEOF
}

build() { # build NAME: make the venv in the stack's root and install everything into it
  local name=$1 root python torch xla tag wheels wheel
  root=$(stack_root_dir "$name")
  python=$(stack_var "$name" PYTHON)
  torch=$(stack_var "$name" TORCH)
  xla=$(stack_var "$name" XLA)
  stack_make_root "$name" || return 1
  local vpy=/venvs/$name/bin/python
  [ -f "$root/venvs/$name/pyvenv.cfg" ] || stack_exec "$root" "$python" -m venv "/venvs/$name" || return 1
  # uv, this checkout's (/nbaccel/.tools: uv_ready), with a cache of its own in pip's mounted
  # one (copies: the venv is on another mount) and PyPI as the root's pip sees it
  local pip=(UV_CACHE_DIR=/root/.cache/pip/uv UV_LINK_MODE=copy
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
    /nbaccel/.tools/uv/bin/uv pip install -q --compile-bytecode --python "$vpy")
  tag=$(stack_exec "$root" "$vpy" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheels=/root/.cache/pip/nbaccel-torch-wheels/$tag
  local want=("torch==$torch")
  [ -z "$xla" ] || want+=("torch_xla==$xla")
  stack_exec "$root" "$vpy" -m pip download -q --no-deps -d "$wheels" "${want[@]}" || return 1
  wheel=$(cd "$PIP_CACHE/nbaccel-torch-wheels/$tag" && ls torch-"$torch"-*.whl | head -n1)
  local big=("$wheels/$wheel")
  if [ -n "$xla" ]; then
    big+=("$wheels/$(cd "$PIP_CACHE/nbaccel-torch-wheels/$tag" && ls torch_xla-"$xla"-*.whl | head -n1)")
  fi
  # torch's and torch_xla's own requirements (with markers) from the wheels, minus the GPU ones.
  local reqs
  mapfile -t reqs < <(python3 - "${big[@]/#\/root\/.cache\/pip/$PIP_CACHE}" <<'PYEOF'
import sys, zipfile
from email.parser import Parser
for path in sys.argv[1:]:
    with zipfile.ZipFile(path) as whl:
        meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA")))
    for req in Parser().parsestr(meta.decode()).get_all("Requires-Dist") or []:
        if "extra ==" in req or req.lower().startswith(("nvidia-", "triton", "cuda-", "torch")):
            continue
        print(req)
PYEOF
)
  stack_exec "$root" "${pip[@]}" --no-deps "${big[@]}" || return 1
  # shellcheck disable=SC2046  # the stack's pins are words
  stack_exec "$root" "${pip[@]}" "${reqs[@]}" "${DEPS[@]}" "${TEST_DEPS[@]}" \
    $(stack_var "$name" PIP) || return 1
  editable_turn stack_exec "$root" "${pip[@]}" --no-deps -e /nbaccel || return 1
  local lib
  lib=$(stack_exec "$root" "$vpy" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0], "lib"))')
  stack_exec "$root" "$vpy" scripts/cuda_stubs.py "$lib" >/dev/null || return 1
}

uv_ready  # the uv the roots run, from the checkout they mount
status=0
for name in "${NAMES[@]}"; do
  if [ -z "$(stack_var "$name" SUITE)" ]; then
    echo "setup_stack.sh: unknown stack '$name' (scripts/stacks.env has: $STACKS $EXTRA_STACKS)" >&2
    status=1
    continue
  fi
  # One builder per root at a time: the roots are shared by every checkout on the machine.
  mkdir -p "$STACKS_DIR"
  exec {lock}>"$(stack_root_dir "$name").lock"
  if ! flock -x -w 1800 "$lock"; then
    echo "setup_stack.sh: stack $name: another build held $(stack_root_dir "$name").lock for 30 min" >&2
    status=1
  elif ! check "$name" 2>/dev/null && { ! build "$name" || ! check "$name"; }; then
    echo "setup_stack.sh: stack $name could not be built (the error is above)" >&2
    status=1
  fi
  exec {lock}>&-
done
exit "$status"
