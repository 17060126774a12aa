# Sourced by the set-up scripts. Every editable install of this checkout rewrites its
# nbaccel.egg-info (.venv, .xla-venv, the matrix venvs, the stacks'): they take turns through
# one lock file, so the set-ups themselves may run side by side (scripts/test.sh does).
# editable_turn CMD...: run CMD (a command or a shell function) holding the lock.
editable_turn() {
  (
    flock 9
    "$@"
  ) 9>"$(dirname "${BASH_SOURCE[0]}")/../.editable.lock"
}
