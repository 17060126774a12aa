"""Issue 35 in a REAL kernel: what a notebook user reads when a run fails.

* a failed background run (``block=False``) shows its exception -- type, message, rank,
  the user's frames -- in the cell that launched it, with or without ``watch``, and in no
  other cell; torch's C++ stack dumps from the ranks are not forwarded;
* running the launching cell again while its run is alive is refused, naming the run;
* a blocking launch's and a pool call's error leads with the user's cell and error (no
  nbaccel frames, no earlier failure chained after a pool restart) and says how to get
  pdb on the failing frame; ``nbaccel.debug()`` misuse reads as a message.

One kernel for the module; each launch is checked for several points at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, module_kernel

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import os, time
import nbaccel
from nbaccel import Accelerator, notebook_launcher, start_workers
from nbaccel.monitor import watch

def fails_when_told(flag):
    accelerator = Accelerator()
    while not os.path.exists(flag):           # until the test says so
        time.sleep(0.05)
    if accelerator.process_index == 1:
        raise ValueError("bad batch on purpose")
    accelerator.wait_for_everyone()           # rank 0 waits for rank 1, which is gone
    return 0

def sleeps():
    time.sleep(120)

def dies_or_raises(die):
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        if die:
            os._exit(3)
        time.sleep(0.5)
        raise ValueError("second failure")
    if not die:
        accelerator.wait_for_everyone()       # rank 0 is in a collective when rank 1 fails
    return 0
"""

# Files of nbaccel's own code that a user should not have to read through.
OURS = ("launcher.py", "handle.py", "pool.py", "_supervisor.py", "debugger.py")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    yield from module_kernel(tmp_path_factory, SETUP)


@pytest.fixture(autouse=True)
def _kernel_left_clean(kernel: KernelSession) -> Iterator[None]:
    yield
    if kernel.busy or not kernel.is_alive():
        kernel.restart()
        kernel.run(SETUP, timeout=120)
    kernel.execute("for p in list(nbaccel.launch.pool._LIVE): p.close()", timeout=30)
    kernel.assert_no_descendants(timeout=10)


def _no_frames_of_ours(text: str) -> None:
    shown = [name for name in OURS if f"/{name}" in text]
    assert not shown, f"nbaccel's frames in what the user reads ({shown}):\n{text}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("watched", [False, True], ids=["plain", "watch"])
def test_a_failed_background_run_speaks_in_its_own_cell(kernel, tmp_path, watched):
    flag = tmp_path / "go"
    launch_code = f"h = notebook_launcher(fails_when_told, args=({str(flag)!r},), num_processes=2, block=False)"
    if watched:
        launch_code += "\nmonitor = watch(h)"
    launch = kernel.run(launch_code, timeout=120)
    again = kernel.execute(launch_code, timeout=60)  # the same cell, run again
    other = kernel.run("x = 1 + 1\nx", timeout=30)
    assert again.error is not None and again.error.ename == "LaunchError", again.describe()
    assert "still going" in again.error.evalue and "notebook_launcher(fails_when_told)" in (
        again.error.evalue
    ), again.describe()
    # a front end clears the cell it runs again: the run's output follows it there
    assert "Its output shows in this cell from now on." in again.error.evalue
    if watched:  # and so does its monitor
        assert again.displays("application/vnd.jupyter.widget-view+json"), again.describe()
    assert kernel.evaluate("len(h.pids)") == "2"  # the first run goes on, alone
    flag.write_text("go")
    waiting = kernel.run("h.wait(120)", timeout=150)
    kernel.drain(0.5)

    assert launch.error is None, launch.describe()  # the earlier run of the cell: cleared
    error = again.error
    assert error is not None and error.ename == "ValueError", again.describe()
    text = error.text
    assert "rank 1" in text and "bad batch on purpose" in text, text
    assert 'raise ValueError("bad batch on purpose")' in text  # the user's frame
    assert "notebook_launcher(fails_when_told)" in text and "debug=True" in text, text
    _no_frames_of_ours(text)
    assert "frame #" not in again.stderr + again.stdout, again.describe()  # no C++ stacks
    for cell in (other, waiting):  # the run's failure is in its cell only
        assert "bad batch" not in cell.describe(), cell.describe()
    assert other.streams == {} and waiting.streams == {}
    asked = kernel.execute("h.result()", timeout=30)  # still there for whoever asks
    assert asked.error is not None and asked.error.ename == "ValueError", asked.describe()
    _no_frames_of_ours(asked.error.text)


@pytest.mark.timeout(240)
def test_a_failure_the_cell_waits_for_is_raised_there_not_shown_twice(kernel, tmp_path):
    flag = tmp_path / "go"
    flag.write_text("go")
    caught = kernel.execute(
        f"h = notebook_launcher(fails_when_told, args=({str(flag)!r},), num_processes=2, "
        "block=False)\ntry:\n    h.result(timeout=120)\nexcept ValueError as err:\n"
        "    print('caught', err.__class__.__name__)",
        timeout=150,
    )
    kernel.drain(0.5)
    # result() raised it to the cell's own code, which handled it: no error output beside
    assert caught.error is None and "caught ValueError" in caught.stdout, caught.describe()


@pytest.mark.timeout(240)
def test_errors_lead_with_the_users_error(kernel, tmp_path):
    flag = tmp_path / "go"
    flag.write_text("go")
    blocking = kernel.execute(f"notebook_launcher(fails_when_told, ({str(flag)!r},), 2)", 120)
    assert blocking.error is not None and blocking.error.ename == "ValueError"
    text = blocking.error.text
    assert "----> 1 notebook_launcher(" in text, text  # the user's cell (IPython 7 and 8+)
    assert "bad batch on purpose" in text and "rank 1" in text, text
    assert "debug=True" in text and "nbaccel.debug()" in text, text
    _no_frames_of_ours(text)

    in_kernel = kernel.execute("notebook_launcher(lambda: 1 / 0)", 60)  # one process: here
    assert in_kernel.error is not None and in_kernel.error.ename == "ZeroDivisionError"
    _no_frames_of_ours(in_kernel.error.text)

    kernel.run("pool = start_workers(num_processes=2)", timeout=120)
    died = kernel.execute("pool.run(dies_or_raises, True)", timeout=120)  # the pool restarts
    assert died.error is not None and "restarted its workers" in died.stderr, died.describe()
    second = kernel.execute("pool.run(dies_or_raises, False)", timeout=120)
    assert second.error is not None and second.error.ename == "ValueError", second.describe()
    text = second.error.text
    assert "second failure" in text and "During handling" not in text, text
    assert "exited" not in text and "nbaccel.debug()" in text, text
    _no_frames_of_ours(text)
    # the pool interrupted rank 0 itself, after rank 1's failure: it says so
    assert "of the interrupt after rank 1 failed" in second.stderr, second.describe()
    msg_id = kernel.submit("nbaccel.debug()")
    assert "(Pdb)" in kernel.wait_for_input_request(timeout=60)
    kernel.interrupt()  # the stop button at the (Pdb) prompt
    session = kernel.collect(msg_id, timeout=60)
    assert session.error is not None and session.error.ename == "KeyboardInterrupt"
    assert "session on rank 1 was interrupted" in session.error.text, session.describe()
    _no_frames_of_ours(session.error.text)
    assert "site-packages/ipykernel" not in session.error.text, session.error.text
    header = session.stdout
    assert "--- rank 0: ---" in header and "accelerator.wait_for_everyone()" in header, header
    assert "(waiting in torch.distributed" in header, header  # what it waits in stays
    assert "nbaccel/runtime" not in header and "distributed_c10d.py" not in header, header

    misuse = kernel.execute("nbaccel.debug(5)", timeout=60)
    assert misuse.error is not None and misuse.error.ename == "LaunchError"
    assert "rank 5" in misuse.error.text, misuse.describe()
    _no_frames_of_ours(misuse.error.text)
    kernel.run("pool.close()", timeout=60)


PANEL_CELL = """
from nbaccel.widgets import LaunchPanel
from nbaccel.platform.environment import cpu_count

def seven():
    return 7

keep = os.sched_getaffinity(0)
os.sched_setaffinity(0, {min(keep)})          # one core: two processes are too many
try:
    small = LaunchPanel(seven)
    start = small.controls["num_processes"].value
    small.controls["num_processes"].value = 2
    one_core = (start, small.warnings())
    notebook_launcher(seven, num_processes=2)
finally:
    os.sched_setaffinity(0, keep)
panel = LaunchPanel(seven)
started_at = panel.controls["num_processes"].value
panel.launch()
"""


@pytest.mark.timeout(240)
def test_the_panel_and_the_launcher_agree_and_the_panel_says_what_happened(kernel):
    cell = kernel.run(PANEL_CELL, timeout=180)
    start, advice = kernel.evaluate_json("one_core")  # the panel on one core: 1, or a warning
    warned = advice["num_processes"]
    assert start == 1 and warned.startswith("2 processes on 1 CPU core(s) here"), advice
    assert f"RuntimeWarning: nbaccel: {warned}" in cell.stderr, cell.describe()  # the same
    assert kernel.evaluate_json("started_at == min(cpu_count(), 8)") is True  # fits the machine
    assert "returned <code>7</code>" in kernel.evaluate_json("panel.status.value")

    kernel.run(  # a background run from the button, stopped with the panel's Stop button
        "panel.training_function = sleeps\n"
        "panel.background.value = True\n"
        "panel.launch_button.click()\n"
        "shown = panel.stop_button.layout.display\n"
        "panel.stop_button.click()\n"
        "panel.handle.wait(60)\n"
        "deadline = time.monotonic() + 600\n"  # a hang guard: the run's end is the event
        "while panel._running and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)",
        timeout=120,
    )
    assert kernel.evaluate_json("shown") is None  # visible while the run goes
    assert kernel.evaluate_json("panel.stop_button.layout.display") == "none"
    assert kernel.evaluate_json("panel.status.value") == "Stopped."


@pytest.mark.timeout(180)
def test_the_stop_button_while_no_cell_runs_stops_the_background_run(kernel):
    launch = kernel.run("hs = notebook_launcher(sleeps, num_processes=2, block=False)", 120)
    kernel.interrupt()  # the kernel is idle: before, nothing happened and nothing said so
    done = kernel.run("print(hs.wait(60), type(hs.exception()).__name__)", timeout=90)
    kernel.drain(0.5)
    assert done.stdout == "True Stopped\n", done.describe()
    assert "the kernel's stop button stopped notebook_launcher(sleeps)" in launch.stderr
    assert launch.error is None  # a stop is the user's doing: no error output
    # while a cell runs, the button interrupts that cell, as always
    msg_id = kernel.submit("print('busy', flush=True); time.sleep(60)")
    kernel.wait_for_output(msg_id, r"busy", timeout=30)
    kernel.interrupt()
    busy = kernel.collect(msg_id, timeout=30)
    assert busy.error is not None and busy.error.ename == "KeyboardInterrupt", busy.describe()
