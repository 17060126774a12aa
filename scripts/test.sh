#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite on the pinned dev torch,
# then the launcher/runtime/platform/checkpoint/kernel tests on every other torch of the matrix
# (scripts/torch_matrix.env: the oldest torch setup.cfg claims and the newest release), then
# the hosted-notebook stacks (scripts/stacks.env: Colab-like and Kaggle-like, in Debian roots
# with their Python, started beside the main run), and print one summary line per torch
# version and stack at the end.
# Extra arguments go to the main pytest run (e.g. `bash scripts/test.sh -k launcher`);
# NBACCEL_TORCH_MATRIX=0 skips the matrix runs, NBACCEL_STACKS=0 the stacks,
# NBACCEL_TEST_WORKERS=N sets the main run's pytest-xdist workers (default 2; 0: one process).
#
# What runs beside what (the tests mostly wait on worker processes and kernels; measured in
# the README, "Tested matrix"):
#   setup.sh, setup_browser.sh (.venv)
#   setup_xla.sh (.xla-venv)              | ruff, mypy
#   main pytest run, in 2 xdist workers   | setup_torch_matrix.sh, then the stacks (setup + tests)
#   the matrix versions side by side      | the stacks, if still running
# The editable installs of this checkout never run at the same time (each rewrites
# nbaccel.egg-info here): setup.sh, setup_browser.sh, setup_xla.sh, then the matrix venvs,
# then the stacks'.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
took() { echo "=== test.sh: $1 done at $((SECONDS - started))s"; }
bash scripts/setup.sh          # .venv: torch==2.13.0 (CPU), nbaccel -e [notebook,test]
bash scripts/setup_browser.sh  # Debian chromium + playwright + jupyterlab, for tests marked `browser`
took "setup.sh, setup_browser.sh"
SUMMARY=$(mktemp)
LOG=$(mktemp)
PARTS=$(mktemp -d)
trap 'rm -rf "$SUMMARY" "$LOG" "$PARTS"' EXIT
# run_part NAME CMD...: CMD's output to $PARTS/NAME.log, its exit status to $PARTS/NAME.code
# (for the parts that run in the background; `set -e` does not end them half-way)
run_part() {
  local name=$1 code=0
  shift
  "$@" >"$PARTS/$name.log" 2>&1 || code=$?
  echo "$code" >"$PARTS/$name.code"
}
part_ok() { [ "$(cat "$PARTS/$1.code" 2>/dev/null || echo 1)" -eq 0 ]; }

# .xla-venv (for tests marked `xla`: torch 2.9.0 + torch_xla 2.9.0) is set up beside the
# linters: it mostly unpacks wheels, they mostly compute. A lint failure still ends the run
# here, once the setup is done (nothing is left running).
run_part xla bash scripts/setup_xla.sh &
lint=0
.venv/bin/ruff check nbaccel tests bench scripts || lint=1
.venv/bin/ruff format --check nbaccel tests bench scripts || lint=1
.venv/bin/mypy nbaccel || lint=1
wait
cat "$PARTS/xla.log"
part_ok xla || exit 1
[ "$lint" -eq 0 ] || exit 1
took "setup_xla.sh, ruff, mypy"

status=0
# Beside the main run, one after the other: the torch matrix's venvs (scripts/
# setup_torch_matrix.sh; its tests run after the main run) and the hosted-notebook stacks
# (setup and tests). Both mostly download, unpack and wait on kernels. Each log is printed
# whole at the end.
matrix=${NBACCEL_TORCH_MATRIX:-1}
stacks=${NBACCEL_STACKS:-1}
if [ "$matrix" != "0" ] || [ "$stacks" != "0" ]; then
  (
    # a failed setup is retried and reported by scripts/test_torch_matrix.sh
    [ "$matrix" = "0" ] || run_part matrix-setup bash scripts/setup_torch_matrix.sh
    [ "$stacks" = "0" ] ||
      NBACCEL_SUMMARY_FILE=$PARTS/stacks.summary run_part stacks bash scripts/test_stacks.sh
  ) &
  beside=$!
fi
# The main run in pytest-xdist workers, one test file per worker at a time (--dist loadfile:
# a module's kernel or pool fixture is started once); tests assume nothing about what runs
# beside them (tmp_path per test, free ports, no fixed paths).
# NBACCEL_REQUIRE_ALL=1: a skipped browser/xla/kernel/integration test fails the run (see conftest.py)
workers=${NBACCEL_TEST_WORKERS:-2}
xdist=(-n "$workers")
[ "$workers" = "0" ] || xdist+=(--dist loadfile)
NBACCEL_REQUIRE_ALL=${NBACCEL_REQUIRE_ALL:-1} .venv/bin/python -m pytest "${xdist[@]}" \
  --durations=25 "$@" 2>&1 | tee "$LOG" || status=1
took "main pytest run"
DEV_TORCH=$(.venv/bin/python -c 'import torch; print(torch.__version__)')
main_summary=$(grep -E '^=*\s*[0-9]+ (passed|failed|error)' "$LOG" | tail -n1 | sed -E 's/^=+ //; s/ =+$//')
echo "torch $DEV_TORCH (dev pin, whole suite): ${main_summary:-no summary}" >"$SUMMARY"

# The torch matrix's versions run side by side (their tests mostly wait on processes and
# kernels; see scripts/test_torch_matrix.sh), while the stacks may still be running; its
# venvs were set up beside the main run (the script finds them ready).
if [ "$matrix" != "0" ]; then
  while [ ! -e "$PARTS/matrix-setup.code" ] && kill -0 "$beside" 2>/dev/null; do sleep 2; done
  cat "$PARTS/matrix-setup.log" 2>/dev/null || true
  NBACCEL_SUMMARY_FILE=$PARTS/matrix.summary run_part matrix bash scripts/test_torch_matrix.sh &
fi
wait
took "torch matrix and stacks"
for part in matrix stacks; do
  [ -e "$PARTS/$part.log" ] || continue
  cat "$PARTS/$part.log"
  cat "$PARTS/$part.summary" >>"$SUMMARY" 2>/dev/null || true
  part_ok "$part" || status=1
done

echo
echo "============ test summary: passed tests per torch version and hosted-notebook stack ============"
cat "$SUMMARY"
passed=$({ grep -oE '[0-9]+ passed' "$SUMMARY" || true; } | awk '{s += $1} END {print s + 0}')
failed=$({ grep -oE '[0-9]+ (failed|errors?)' "$SUMMARY" || true; } | awk '{s += $1} END {print s + 0}')
echo "all: $passed passed, $failed failed$([ "$status" -eq 0 ] || echo " (exit 1: see the lines above)")"
exit "$status"
