"""The suite's own guards (tests/conftest.py), checked by running pytest on small suites."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from waits import HANG_GUARD_S

CONFTEST = Path(__file__).with_name("conftest.py")
INI = "[pytest]\nmarkers =\n    integration: x\n    kernel: x\n    browser: x\n    xla: x\n    faults: x\n"


def _pytest(
    tmp_path: Path,
    source: str,
    *args: str,
    require_all: bool = False,
    cpu_top: int = 0,
    ini: str = "",
):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(INI + ini)
    (tmp_path / "test_case.py").write_text(source)
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("NBACCEL_REQUIRE_ALL", "NBACCEL_CPU_TOP")
    }
    if require_all:
        env["NBACCEL_REQUIRE_ALL"] = "1"
    if cpu_top:
        env["NBACCEL_CPU_TOP"] = str(cpu_top)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         *args, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER")
def test_an_orphaned_grandchild_is_a_leak(tmp_path):
    out = _pytest(
        tmp_path,
        "import subprocess\n"
        "def test_orphan():\n"
        "    subprocess.run(['sh', '-c', 'sleep 60 > /dev/null 2>&1 &'], check=True)\n",
    )
    assert out.returncode == 1, out.stdout
    assert "left child processes" in out.stdout and "sleep" in out.stdout, out.stdout


def test_an_unwaited_zombie_is_a_leak(tmp_path):
    out = _pytest(
        tmp_path,
        "import subprocess, time\n"
        "keep = []\n"
        "def test_zombie():\n"
        "    keep.append(subprocess.Popen(['true']))\n"
        "    time.sleep(0.5)\n",
    )
    assert out.returncode == 1, out.stdout
    assert "zombie" in out.stdout, out.stdout


def test_a_tests_own_timeout_below_the_guard_is_lifted_to_it(tmp_path):
    """A test's own timeout mark below the suite's guard was a speed bound (issue 49): it is
    lifted to the guard, and the guard still ends a real hang."""
    out = _pytest(
        tmp_path,
        "import pytest, time\n"
        "@pytest.mark.timeout(1)\n"
        "def test_slower_than_its_mark():\n"
        "    time.sleep(2)\n"
        "@pytest.mark.timeout(1)\n"
        "def test_hangs():\n"
        "    time.sleep(120)\n",
        ini="timeout = 4\n",
    )
    assert "1 failed, 1 passed" in out.stdout, out.stdout
    assert "test_hangs" in out.stdout and "Timeout (>4.0s)" in out.stdout, out.stdout


def test_clean_tests_pass(tmp_path):
    out = _pytest(
        tmp_path,
        "import subprocess\n"
        "def test_ok():\n"
        "    subprocess.run(['sh', '-c', 'sleep 0.2 & wait'], check=True)\n",
    )
    assert out.returncode == 0, out.stdout
    assert "CPU per test file" not in out.stdout  # only where NBACCEL_CPU_TOP asks for it


def test_require_all_counts_module_skips_and_marker_deselection(tmp_path):
    source = (
        "import pytest\n"
        "@pytest.mark.kernel\n"
        "def test_kernel():\n"
        "    pass\n"
        "def test_plain():\n"
        "    pass\n"
    )
    out = _pytest(tmp_path, source, "-m", "not kernel", require_all=True)
    assert out.returncode == 1, out.stdout
    assert "test_kernel (kernel) was deselected" in out.stdout, out.stdout
    assert _pytest(tmp_path, source, "-m", "not kernel").returncode == 0
    assert _pytest(tmp_path, source, "-k", "plain", require_all=True).returncode == 0
    skipped = "import pytest\npytest.importorskip('no_such_module_xyz')\ndef test_a():\n    pass\n"
    out = _pytest(tmp_path, skipped, require_all=True)
    assert out.returncode == 1, out.stdout
    assert "skipped whole at collection" in out.stdout and "no_such_module_xyz" in out.stdout


def test_require_all_counts_what_xdist_workers_deselect_and_skip(tmp_path):
    # scripts/test.sh runs the suite in pytest-xdist workers: -m deselection and module skips
    # happen there, and the controller must still fail the run and name them
    pytest.importorskip("xdist", reason="pytest-xdist (the test extra) is not installed")
    source = "import pytest\n@pytest.mark.kernel\ndef test_kernel():\n    pass\n"
    source += "def test_plain():\n    pass\n"
    out = _pytest(tmp_path, source, "-n", "2", "-m", "not kernel", require_all=True)
    assert out.returncode == 1, out.stdout
    assert "test_kernel (kernel) was deselected" in out.stdout, out.stdout
    assert _pytest(tmp_path, source, "-n", "2", require_all=True).returncode == 0
    skipped = "import pytest\npytest.importorskip('no_such_module_xyz')\ndef test_a():\n    pass\n"
    out = _pytest(tmp_path, skipped, "-n", "2", require_all=True)
    assert out.returncode == 1, out.stdout
    assert out.stdout.count("skipped whole at collection") == 1, out.stdout  # named once
    assert "no_such_module_xyz" in out.stdout, out.stdout


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist"])
def test_the_cpu_report_names_the_file_whose_processes_burned_it(tmp_path, workers):
    # scripts/test.sh's guard prints the costliest files (NBACCEL_CPU_TOP): the CPU of the
    # processes a file started counts for it -- here a child that spins for 1.5 s of CPU
    if workers:
        pytest.importorskip("xdist", reason="pytest-xdist (the test extra) is not installed")
    (tmp_path / "test_idle.py").write_text("def test_idle():\n    pass\n")
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass\n"
    source = f"import subprocess, sys\ndef test_spin():\n    subprocess.run([sys.executable, '-c', {spin!r}], check=True)\n"
    args = ("-n", str(workers)) if workers else ()
    out = _pytest(tmp_path, source, *args, cpu_top=5)
    assert out.returncode == 0, out.stdout
    assert "CPU per test file: the 2 costliest of 2" in out.stdout, out.stdout
    rows = [
        line.split() for line in out.stdout.splitlines() if line.endswith(".py") and "CPU" in line
    ]
    assert [row[-1] for row in rows] == ["test_case.py", "test_idle.py"], out.stdout
    assert float(rows[0][0]) >= 1.4 and float(rows[1][0]) < 1.0, out.stdout


def test_no_accelerator_state_passes_from_one_module_to_the_next(tmp_path):
    # a module that creates an Accelerator in the pytest process must not make a later
    # module's launch refuse to start (in xdist workers, which module runs next varies)
    (tmp_path / "test_later.py").write_text(
        "from nbaccel.launch.start._preflight import check_no_state_in_kernel\n"
        "def test_launch_allowed():\n"
        "    check_no_state_in_kernel()\n"
    )
    out = _pytest(
        tmp_path,
        "from nbaccel import Accelerator\n"
        "def test_in_process():\n"
        "    assert Accelerator(cpu=True).num_processes == 1\n",
    )
    assert out.returncode == 0, out.stdout
    assert "2 passed" in out.stdout, out.stdout


def test_the_longest_first_files_exist(pytestconfig):
    # a renamed or moved file would silently lose its place at the front (or end) of the run
    # (`from conftest import ...` may find another folder's conftest first: tests/stacks/)
    root = Path(__file__).resolve().parents[1]
    path = str(root / "tests" / "conftest.py")
    conftest = next(
        p for p in pytestconfig.pluginmanager.get_plugins() if getattr(p, "__file__", "") == path
    )
    listed = conftest.LONGEST_FIRST + conftest.WAITS_FOR_A_LANE
    missing = [path for path in listed if not (root / path).is_file()]
    assert not missing, (
        f"conftest.LONGEST_FIRST or WAITS_FOR_A_LANE names files that do not exist: {missing}"
    )
