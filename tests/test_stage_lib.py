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
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = (line.split("|") for line in (tmp_path / "stages").read_text().splitlines())
    return {name: (int(wall), int(cpu)) for name, wall, cpu, _ in rows}


def test_a_stage_counts_its_own_cpu_not_that_of_a_lane_that_ends_meanwhile(tmp_path):
    # scripts/test.sh: the lanes run in the background and end during the main run; the shell
    # that times the main run reaps them, and bash's `time` counted their CPU in the main run's
    # (each lane's CPU twice in the whole run's sum)
    stages = _stages(tmp_path, 'stage "lane *" 100 spin 2 &\nstage "main" 100 sleep 4\nwait\n')
    assert stages["lane *"][1] >= 2, stages  # its own spin
    wall, cpu = stages["main"]
    assert wall >= 4 and cpu == 0, stages  # a sleep: its four seconds of wall, no CPU
