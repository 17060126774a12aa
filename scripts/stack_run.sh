#!/usr/bin/env bash
# Run a command in a hosted-notebook stack (scripts/stacks.env), with its venv first on PATH
# and this checkout as the working directory (mounted at /nbaccel), e.g.
#   bash scripts/stack_run.sh colab python -m pytest tests/ui/test_widgets.py
# The stack must have been built (bash scripts/setup_stack.sh NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stack_lib.sh
name=${1:?usage: stack_run.sh NAME COMMAND [ARGS...]}
shift
root=$(stack_root_dir "$name")
if [ ! -f "$root/venvs/$name/pyvenv.cfg" ]; then
  echo "stack_run.sh: stack $name is not built: run bash scripts/setup_stack.sh $name" >&2
  exit 2
fi
exec_env=(PATH="/venvs/$name/bin:/usr/local/bin:/usr/bin:/bin" VIRTUAL_ENV="/venvs/$name" \
  NBACCEL_STACK="$name")
stack_exec "$root" "${exec_env[@]}" "$@"
