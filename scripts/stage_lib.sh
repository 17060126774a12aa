# Sourced by scripts/test.sh (and tests/test_stage_lib.py): the time guard's one measure.
#
# stage NAME SHARE CMD...: run CMD; print and record in $PARTS/stages its wall and CPU time
# (user + system of CMD and every process under it) against SHARE, in seconds. SHARE counts
# from the start of the run ($started, bash's SECONDS) when NAME ends in "*": the lanes beside
# the main run. Returns CMD's exit status.
stage() {
  local name=$1 share=$2 code=0 times wall user sys cpu
  shift 2
  times=$(mktemp)
  # CMD is timed in a subshell of its own: bash's `time` counts the CPU of every child its
  # shell reaps meanwhile, and the shell that times the main run also reaps the lanes that
  # end during it (their CPU was counted twice: in their stage and in the main run's)
  (TIMEFORMAT='%R %U %S' && time "$@" 2>&4) 4>&2 2>"$times" || code=$?
  read -r wall user sys <"$times"
  rm -f "$times"
  [[ "$name" != *"*" ]] || wall=$((SECONDS - started))
  read -r wall cpu < <(awk -v w="$wall" -v u="$user" -v s="$sys" 'BEGIN {printf "%.0f %.0f\n", w, u + s}')
  echo "$name|$wall|$cpu|$share" >>"$PARTS/stages"
  echo "=== test.sh: $name: $wall s wall, $cpu s CPU (share $share s) at $((SECONDS - started))s"
  return "$code"
}
