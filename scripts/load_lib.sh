# Sourced by scripts/test.sh (and tests/test_load_lib.py): the slow-machine rehearsal, and the
# measure of the machine's speed that every run states (its figures mean nothing without it).
#
# speed_probe WHEN: a fixed workload (3 million Python multiply-adds, one core) and what it took:
# its CPU seconds are the core's speed (about 0.6 s on the README's machine), its wall seconds
# over its CPU seconds the contention at that moment (1.0 on an idle machine).
# load_start N: start N CPU-burning processes at normal priority and say so; their pids go to
# $LOAD_PIDS. Each burner is a session of its own (setsid), as another tenant's work is: Linux
# shares the CPU between sessions first (autogroup scheduling, on here and on CI's machines),
# then between the processes of a session, and every Jupyter kernel, nbaccel worker and Ray
# node of the suite is a session of its own. So burners in the run's own session would slow
# only the run's pytest and lanes, whatever the load average says; in sessions of their own,
# 2 burners beside the run on 2 cores leave each of its sessions about half the machine.
# Each burner is started by a subshell that exits at once, so it is not a job of this shell:
# test.sh's bare `wait`s never wait for it.
# Each burner also checks, between bursts of about a tenth of a second, that the shell that
# started it still lives: a run killed with SIGKILL (no trap runs) leaves no burner behind.
# load_stop: end them (SIGKILL: a busy loop needs no grace) and say how long they ran.
# N must be a whole number; anything else is refused before anything starts.
LOAD_PIDS=()
LOAD_STARTED=0
load_start() {
  local n=${1:-0} pid i
  if ! [[ "$n" =~ ^[0-9]+$ ]]; then
    echo "NBACCEL_TEST_LOAD must be a whole number of CPU burners (e.g. NBACCEL_TEST_LOAD=2), not '$n'" >&2
    return 2
  fi
  [ "$n" -gt 0 ] || return 0
  for ((i = 0; i < n; i++)); do
    # setsid execs in place (a background job here is no process group leader): $! is the
    # burner's pid. shellcheck disable=SC2016  # the loop is the burner's own script
    pid=$( (setsid bash -c 'exec -a nbaccel-test-load bash -c "$1" "$2"' burner \
      'while kill -0 "$0" 2>/dev/null; do for ((i = 0; i < 100000; i++)); do :; done; done' \
      "$$" </dev/null >/dev/null 2>&1 &
      echo $!))
    LOAD_PIDS+=("$pid")
  done
  LOAD_STARTED=$SECONDS
  echo "=== slow-machine rehearsal: $n CPU burners at normal priority beside the whole run (pids ${LOAD_PIDS[*]})"
}
load_stop() {
  [ "${#LOAD_PIDS[@]}" -gt 0 ] || return 0
  kill -9 "${LOAD_PIDS[@]}" 2>/dev/null || true
  echo "=== slow-machine rehearsal: ended ${#LOAD_PIDS[@]} CPU burners after $((SECONDS - LOAD_STARTED)) s"
  LOAD_PIDS=()
}
speed_probe() {
  python3 - "$1" <<'PYEOF'
import sys, time
cpu, wall = time.process_time(), time.monotonic()
total = 0
for i in range(3_000_000):
    total += i * i
cpu, wall = time.process_time() - cpu, time.monotonic() - wall
print(f"=== machine speed {sys.argv[1]}: a fixed workload took {cpu:.2f} CPU-s, {wall:.2f} s wall "
      f"(contention {wall / max(cpu, 1e-9):.1f}x)")
PYEOF
}
