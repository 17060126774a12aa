"""scripts/stage_lib.sh: the time guard's measure of a stage's wall and CPU time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "import time, sys\nt = time.process_time()\nwhile time.process_time() - t < float(sys.argv[1]): pass\n"


def _stages(tmp_path: Path, body: str) -> dict[str, tuple[int, int]]:
    (tmp_path / "spin.py").write_text(SPIN)
    script = (
        "set -euo pipefail\n"
        f"cd {ROOT}\n"
        "source scripts/stage_lib.sh\n"
        f"started=$SECONDS PARTS={tmp_path}\n"
        f'spin() {{ "{sys.executable}" "{tmp_path / "spin.py"}" "$1"; }}\n' + body
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = (line.split("|") for line in (tmp_path / "stages").read_text().splitlines())
    return {name: (int(wall), int(cpu)) for name, wall, cpu, _ in rows}


def test_a_stage_counts_its_own_cpu_not_that_of_a_lane_that_ends_meanwhile(tmp_path):
    # scripts/test.sh: the lanes run in the background and end during the main run; the shell
    # that times the main run reaps them, and bash's `time` counted their CPU in the main run's
    # (each lane's CPU twice in the whole run's sum). The overlap is forced by events, not
    # timed: the lane spins only once the main stage has started (a file it creates), and the
    # main stage lasts until the lane is gone (reaped by the shell timing it), however slow
    # the machine is.
    body = (
        f'lane() {{ until [[ -e "{tmp_path}/main_started" ]]; do sleep 0.05; done; spin 2; }}\n'
        f'main() {{ touch "{tmp_path}/main_started"\n'
        '  while kill -0 "$lane_pid" 2>/dev/null; do sleep 0.2; done; }\n'
        'stage "lane *" 100 lane &\nlane_pid=$!\nstage "main" 100 main\nwait\n'
    )
    stages = _stages(tmp_path, body)
    assert stages["lane *"][1] >= 2, stages  # its own spin
    assert stages["main"][1] == 0, stages  # a wait: no CPU of its own, none of the lane's
