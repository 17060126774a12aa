#!/usr/bin/env bash
# Run the tests marked `matrix` (tests/conftest.py states the rule) on every matrix torch
# (scripts/torch_matrix.env), each in its .torch-venvs/<version> (made here when missing by
# scripts/setup_torch_matrix.sh). Prints one line per version, e.g.
#   torch 2.4.1: 190 passed in 250.1s
# and appends the same lines to $NBACCEL_SUMMARY_FILE when that is set (scripts/test.sh).
# Exit status: non-zero when any version's run failed (every version still runs).
#
# Usage: bash scripts/test_torch_matrix.sh [VERSION ...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/torch_matrix.env
if [ "$#" -gt 0 ]; then VERSIONS=("$@"); else read -r -a VERSIONS <<<"$TORCH_MATRIX"; fi
read -r -a TESTS <<<"$TORCH_MATRIX_TESTS"
IGNORE=()
for path in $TORCH_MATRIX_IGNORE; do IGNORE+=("--ignore=$path"); done
if ! bash scripts/setup_torch_matrix.sh "${VERSIONS[@]}"; then
  line="torch ${VERSIONS[*]}: NOT RUN, scripts/setup_torch_matrix.sh failed (its error is above)"
  echo "$line"
  if [ -n "${NBACCEL_SUMMARY_FILE:-}" ]; then echo "$line" >>"$NBACCEL_SUMMARY_FILE"; fi
  exit 1
fi

status=0
lines=()
# The versions run at the same time: these tests mostly wait on worker processes and kernels
# (one run uses about a third of 2 cores: 2m49s of CPU in 4m07s), so running them side by
# side saves minutes of CI; each log is printed whole once its run ends, never interleaved.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run_version() {
  # DeepSpeed (the optional extra) is installed and tested in .venv only: its tests are
  # deselected in the other torch versions (the summary line says so).
  local version=$1 select=(-k "not deepspeed")
  # strategy='fsdp' needs a newer torch than the floor (nbaccel.platform.torchcompat.
  # FSDP_MIN_TORCH; older ones get a clear ConfigError, tested in test_torchcompat.py):
  # its tests are deselected there, and the summary line says so.
  if ! ".torch-venvs/$version/bin/python" -c \
    'import sys; from nbaccel.platform.torchcompat import fsdp_supported; sys.exit(not fsdp_supported())'; then
    select=(-k "not fsdp and not deepspeed")
    touch "$tmp/$version.nofsdp"
  fi
  echo "=== torch $version: -m $TORCH_MATRIX_MARK ${TESTS[*]} ${IGNORE[*]} ${select[*]}"
  # NBACCEL_REQUIRE_ALL=1: a skipped kernel/integration test fails here as in the main run.
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} NBACCEL_REQUIRE_ALL=${NBACCEL_REQUIRE_ALL:-1} \
    ".torch-venvs/$version/bin/python" -m pytest -q -p no:cacheprovider \
    -m "$TORCH_MATRIX_MARK" "${IGNORE[@]}" "${select[@]}" "${TESTS[@]}"
}
for version in "${VERSIONS[@]}"; do
  (run_version "$version" >"$tmp/$version.log" 2>&1; echo $? >"$tmp/$version.code") &
done
wait
for version in "${VERSIONS[@]}"; do
  cat "$tmp/$version.log"
  code=$(cat "$tmp/$version.code" 2>/dev/null || echo 1)
  # pytest's closing line, e.g. "190 passed, 2 deselected in 250.10s (0:04:10)"
  summary=$(grep -E '^=*\s*[0-9]+ (passed|failed|error)' "$tmp/$version.log" | tail -n1 | sed -E 's/^=+ //; s/ =+$//')
  [ "$code" -eq 0 ] || status=1
  note=" (DeepSpeed tests deselected: the deepspeed extra is tested in .venv)"
  [ ! -e "$tmp/$version.nofsdp" ] || note=" (FSDP and DeepSpeed tests deselected: strategy='fsdp' needs a newer torch)"
  lines+=("torch $version: ${summary:-no summary (pytest exit $code)}$note")
done

echo "=== torch matrix (${TESTS[*]})"
for line in "${lines[@]}"; do
  echo "$line"
  if [ -n "${NBACCEL_SUMMARY_FILE:-}" ]; then echo "$line" >>"$NBACCEL_SUMMARY_FILE"; fi
done
exit "$status"
