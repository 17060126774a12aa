#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite on the pinned dev torch,
# then the launcher/runtime/platform/checkpoint/kernel tests on every other torch of the matrix
# (scripts/torch_matrix.env: the oldest torch setup.cfg claims and the newest release), then
# the hosted-notebook stacks (scripts/stacks.env: Colab-like and Kaggle-like, in Debian roots
# with their Python, started beside the main run), and print one summary line per torch
# version and stack at the end.
# Extra arguments go to the main pytest run (e.g. `bash scripts/test.sh -k launcher`);
# NBACCEL_TORCH_MATRIX=0 skips the matrix runs, NBACCEL_STACKS=0 the stacks. The stacks run
# beside the main run, the matrix versions side by side after it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh          # .venv: torch==2.13.0 (CPU), nbaccel -e [notebook,test]
bash scripts/setup_browser.sh  # Debian chromium + playwright + jupyterlab, for tests marked `browser`
bash scripts/setup_xla.sh      # .xla-venv: torch 2.9.0 + torch_xla 2.9.0, for tests marked `xla`
.venv/bin/ruff check nbaccel tests bench scripts
.venv/bin/ruff format --check nbaccel tests bench scripts
.venv/bin/mypy nbaccel

SUMMARY=$(mktemp)
LOG=$(mktemp)
PARTS=$(mktemp -d)
trap 'rm -rf "$SUMMARY" "$LOG" "$PARTS"' EXIT
status=0
# The hosted-notebook stacks start now, beside the main run: their setup is mostly unpacking
# and their tests mostly wait on kernels (the whole CI went past 30 minutes with them after
# the main run); the torch matrix runs after the main run. Each log is printed whole at the end.
if [ "${NBACCEL_STACKS:-1}" != "0" ]; then
  (NBACCEL_SUMMARY_FILE=$PARTS/stacks.summary bash scripts/test_stacks.sh \
    >"$PARTS/stacks.log" 2>&1; echo $? >"$PARTS/stacks.code") &
fi
# NBACCEL_REQUIRE_ALL=1: a skipped browser/xla/kernel/integration test fails the run (see conftest.py)
NBACCEL_REQUIRE_ALL=${NBACCEL_REQUIRE_ALL:-1} .venv/bin/python -m pytest "$@" 2>&1 | tee "$LOG" \
  || status=1
DEV_TORCH=$(.venv/bin/python -c 'import torch; print(torch.__version__)')
main_summary=$(grep -E '^=*\s*[0-9]+ (passed|failed|error)' "$LOG" | tail -n1 | sed -E 's/^=+ //; s/ =+$//')
echo "torch $DEV_TORCH (dev pin, whole suite): ${main_summary:-no summary}" >"$SUMMARY"

# The torch matrix's versions run side by side (their tests mostly wait on processes and
# kernels; see scripts/test_torch_matrix.sh), while the stacks may still be running.
if [ "${NBACCEL_TORCH_MATRIX:-1}" != "0" ]; then
  (NBACCEL_SUMMARY_FILE=$PARTS/matrix.summary bash scripts/test_torch_matrix.sh \
    >"$PARTS/matrix.log" 2>&1; echo $? >"$PARTS/matrix.code") &
fi
wait
for part in matrix stacks; do
  [ -e "$PARTS/$part.log" ] || continue
  cat "$PARTS/$part.log"
  cat "$PARTS/$part.summary" >>"$SUMMARY" 2>/dev/null || true
  [ "$(cat "$PARTS/$part.code" 2>/dev/null || echo 1)" -eq 0 ] || status=1
done

echo
echo "============ test summary: passed tests per torch version and hosted-notebook stack ============"
cat "$SUMMARY"
passed=$({ grep -oE '[0-9]+ passed' "$SUMMARY" || true; } | awk '{s += $1} END {print s + 0}')
failed=$({ grep -oE '[0-9]+ (failed|errors?)' "$SUMMARY" || true; } | awk '{s += $1} END {print s + 0}')
echo "all: $passed passed, $failed failed$([ "$status" -eq 0 ] || echo " (exit 1: see the lines above)")"
exit "$status"
