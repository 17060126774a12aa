"""Issue 28 in a real kernel: a run's output stays in the cell that started it.

Every cell runs in a real IPython kernel through jupyter_client; the workers are real
2-process gloo launches (and a warm pool). Output is told apart the way a notebook
front end tells it apart: by each message's parent header. Messages that arrive after
their cell finished are kept (``KernelSession.drain``), so a line of the run that lands
in a later cell -- what happened before -- is seen.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = textwrap.dedent(
    """
    import time
    from tqdm.auto import tqdm
    from nbaccel import Accelerator, notebook_launcher, start_workers

    def chatty(lines, pause):
        accelerator = Accelerator()
        for i in tqdm(range(lines), desc="chatty", mininterval=0):
            print(f"line {i}", flush=True)
            time.sleep(pause)
        print("done", flush=True)
        return accelerator.process_index
    """
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    pytest.importorskip("ipywidgets")
    from kernel_harness import module_kernel

    yield from module_kernel(tmp_path_factory, SETUP)


def test_background_run_output_stays_in_the_launching_cell(kernel):
    launch = kernel.run(
        "handle = notebook_launcher(chatty, args=(30, 0.05), num_processes=2, block=False)",
        timeout=60,
    )
    other = kernel.run("x = 1 + 1\nx", timeout=30)  # while the workers print
    later = kernel.run("time.sleep(0.5); print('later', handle.done())", timeout=30)
    waiting = kernel.run("ranks = handle.result(timeout=120)", timeout=150)
    kernel.drain(1.0)  # anything still on its way
    assert later.stdout == "later False\n", later.describe()  # really ran during the run
    assert other.text == "2" and other.streams == {}, other.describe()
    assert waiting.streams == {} and waiting.outputs == [], waiting.describe()
    for rank in (0, 1):
        assert f"[rank{rank}] line 29\n" in launch.stdout, launch.describe()
        assert f"[rank{rank}] done\n" in launch.stdout
    # rank 0's bar: one output in the launching cell, updated in place, not stderr lines
    assert "chatty" not in launch.stdout + launch.stderr
    bars = [o for o in launch.outputs if "chatty" in str(o["data"].get("text/plain"))]
    assert bars[0]["msg_type"] == "display_data" and len(bars) > 2
    assert {o["msg_type"] for o in bars[1:]} == {"update_display_data"}
    assert "chatty: 100%" in bars[-1]["data"]["text/plain"]
    assert len({o["transient"]["display_id"] for o in bars}) == 1


def test_a_pool_call_in_the_background_keeps_its_output_too(kernel):
    kernel.run("pool = start_workers(num_processes=2)", timeout=120)
    try:
        call = kernel.run("h = pool.call(chatty, (20, 0.05), block=False)", timeout=60)
        other = kernel.run("y = 3\nprint('y', y, h.done())", timeout=30)
        kernel.run("h.result(timeout=120)", timeout=150)
        kernel.drain(1.0)
        assert other.stdout == "y 3 False\n", other.describe()
        assert "[rank1] line 19\n" in call.stdout and "[rank0] done\n" in call.stdout
    finally:
        kernel.run("pool.close()", timeout=60)


def test_a_watched_runs_tqdm_bar_is_drawn_once_and_not_red_when_finished(kernel):
    launch = kernel.run(
        "from nbaccel.monitor import watch\n"
        "hw = notebook_launcher(chatty, args=(10, 0.02), num_processes=2, block=False)\n"
        "mw = watch(hw)",
        timeout=60,
    )
    kernel.run("hw.result(timeout=120); mw.refresh()", timeout=150)
    kernel.drain(0.5)
    # rank 0's bar (the one drawn: rank 0's only) is the monitor's bar, finished and green...
    bar = kernel.evaluate_json("[mw._view.bar.value, mw._view.bar.max, mw._view.bar.bar_style]")
    assert bar == [10.0, 10.0, "success"], bar
    # ...and not drawn a second time as text: neither in the log (stderr lines are red
    # there) nor in the cell
    assert "chatty" not in kernel.evaluate_json("mw.log() + mw._view.log.value")
    view = kernel.evaluate_json("mw._live.id")  # the monitor itself (its last state at the end)
    shown: dict[str, str] = {}  # what the cell shows at the end: each display's last state
    for o in launch.outputs:
        if (display_id := o["transient"].get("display_id")) and display_id != view:
            shown[display_id] = str(o["data"].get("text/plain"))
    # a bar the cell drew before watch() took its output (a loaded machine's first lines) is
    # blanked when the monitor takes over
    text_bars = {d: text for d, text in shown.items() if "chatty" in text}
    assert not text_bars, text_bars
    assert "[rank1] done" in kernel.evaluate_json("mw.log()")
