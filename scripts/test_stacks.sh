#!/usr/bin/env bash
# Run each hosted-notebook stack's tests (scripts/stacks.env): STACK_<name>_TESTS with pytest
# inside the stack's Debian root, then STACK_<name>_HOST_TESTS (e.g. the browser) from this
# machine's .venv against the stack. Builds a stack first when needed (scripts/setup_stack.sh).
# Prints one line per stack, e.g.
#   stack colab (Python 3.13.5, torch 2.11.0+cu130, ipywidgets 7.7.1, ...): 97 passed in 160.2s
# and appends the same lines to $NBACCEL_SUMMARY_FILE when set (scripts/test.sh). A stack that
# could not be built prints NOT RUN and fails the run.
# NBACCEL_STACKS_FULL=1 runs STACK_<name>_FULL_TESTS instead (everything that runs there);
# NBACCEL_EXTRA_STACKS=py314 adds stacks CI leaves out for time (EXTRA_STACKS in stacks.env).
#
# Usage: bash scripts/test_stacks.sh [NAME ...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/stack_lib.sh
if [ "$#" -gt 0 ]; then NAMES=("$@"); else read -r -a NAMES <<<"$STACKS ${NBACCEL_EXTRA_STACKS:-}"; fi

summary_line() { # the numbers of pytest's closing line in $1, e.g. "97 passed, 1 failed"
  grep -E '^=*\s*[0-9]+ (passed|failed|error)' "$1" | tail -n1 | sed -E 's/^=+ //; s/ =+$//' \
    | sed -E 's/ in [0-9.]+s.*$//'
}

count() { # count REGEX FILE: the number before REGEX on pytest's closing line (0 if none)
  summary_line "$2" | grep -oE "[0-9]+ $1\b" | awk '{s += $1} END {print s + 0}'
}

status=0
lines=()
for name in "${NAMES[@]}"; do
  started=$SECONDS
  if ! versions=$(bash scripts/setup_stack.sh "$name" | tail -n1) || [ -z "$versions" ]; then
    lines+=("stack $name: NOT RUN, scripts/setup_stack.sh $name failed (its error is above)")
    status=1
    continue
  fi
  setup_s=$((SECONDS - started))
  field=TESTS
  [ "${NBACCEL_STACKS_FULL:-0}" != "1" ] || field=FULL_TESTS
  read -r -a tests <<<"$(stack_var "$name" "$field")"
  read -r -a host_tests <<<"$(stack_var "$name" HOST_TESTS)"
  root=$(stack_root_dir "$name")
  echo "=== stack $name (${versions#stack "$name": }): ${tests[*]}"
  inside=$(mktemp)
  # NBACCEL_REQUIRE_ALL=1: a skipped kernel/integration/xla test fails here as in the main run.
  # DeepSpeed (an optional extra) is tested in .venv only: not installed in the stacks.
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} NBACCEL_REQUIRE_ALL=${NBACCEL_REQUIRE_ALL:-1} \
    bash scripts/stack_run.sh "$name" python -m pytest -q -p no:cacheprovider -k "not deepspeed" \
    "${tests[@]}" \
    2>&1 | tee "$inside"
  code=${PIPESTATUS[0]}
  host=$(mktemp)
  host_code=0
  if [ "${#host_tests[@]}" -gt 0 ]; then
    echo "=== stack $name, from this machine: ${host_tests[*]}"
    NBACCEL_STACK=$name NBACCEL_STACK_ROOT=$root NBACCEL_REQUIRE_ALL=${NBACCEL_REQUIRE_ALL:-1} \
      .venv/bin/python -m pytest -q -p no:cacheprovider "${host_tests[@]}" 2>&1 | tee "$host"
    host_code=${PIPESTATUS[0]}
  fi
  passed=$(($(count passed "$inside") + $(count passed "$host")))
  failed=$(($(count failed "$inside") + $(count failed "$host")))
  errors=$(($(count 'errors?' "$inside") + $(count 'errors?' "$host")))
  [ "$code" -eq 0 ] && [ "$host_code" -eq 0 ] || status=1
  result="$passed passed, $failed failed"
  [ "$errors" -eq 0 ] || result+=", $errors errors"
  [ "$code" -eq 0 ] && [ "$host_code" -eq 0 ] || result+=" (pytest exit $code/$host_code)"
  lines+=("stack $name (${versions#stack "$name": }): $result in $((SECONDS - started))s (setup ${setup_s}s)")
  rm -f "$inside" "$host"
done

echo "=== hosted-notebook stacks (scripts/stacks.env)"
for line in "${lines[@]}"; do
  echo "$line"
  if [ -n "${NBACCEL_SUMMARY_FILE:-}" ]; then echo "$line" >>"$NBACCEL_SUMMARY_FILE"; fi
done
exit "$status"
