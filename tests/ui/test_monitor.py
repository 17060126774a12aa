"""The live view (nbaccel.monitor) and non-blocking launches (block=False).

Unit tests drive a stand-in handle; integration tests follow real 2-process CPU
launches, from this process and from a real IPython kernel: ``block=False``
returns at once, the kernel runs another cell meanwhile, ``.result()`` returns
rank 0's value and ``.stop()`` terminates every worker.
"""

from __future__ import annotations

import io
import textwrap
import time
from collections.abc import Iterator

import psutil
import pytest
from waits import HANG_GUARD_S

from nbaccel.monitor import RunMonitor, watch

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class FakeHandle:
    """The part of LaunchHandle the monitor uses, fed by hand."""

    def __init__(self, ranks=(0, 1)):
        self._status = {
            r: {"state": "starting", "step": None, "scalars": {}, "pid": None} for r in ranks
        }
        self.listeners = []

    def status(self):
        return {r: {**s, "scalars": dict(s["scalars"])} for r, s in self._status.items()}

    def add_listener(self, callback, *, replay=False):
        self.listeners.append(callback)
        return callback

    def remove_listener(self, callback):
        self.listeners.remove(callback)

    def emit(self, rank, kind, **data):
        entry = self._status[rank]
        if kind == "state":
            entry["state"] = data["state"]
        else:
            if "step" in data:
                entry["step"] = data["step"]
            entry["scalars"].update(data.get("values", {}))
        for callback in list(self.listeners):
            callback(rank, kind, data)


def test_text_view_tracks_states_steps_scalars_and_progress():
    handle = FakeHandle()
    out = io.StringIO()
    monitor = RunMonitor(handle, widget=False, stream=out, interval=0, text_interval=3600)
    assert out.getvalue().splitlines()[1].split() == ["0", "starting"]  # first table at once
    for rank in (0, 1):
        handle.emit(rank, "state", state="running")
        handle.emit(rank, "log", step=5, values={"loss": 0.123456, "acc": 0.5 + rank / 10})
    handle.emit(0, "progress", n=3, total=10, desc="epoch", unit="it", rate=2.0, closed=False)
    assert monitor.text().splitlines() == [
        "rank  state    step  loss    acc",
        "0     running  5     0.1235  0.5",
        "1     running  5     0.1235  0.6",
        "progress (rank 0): epoch: 3/10 (2 it/s)",
    ]
    assert out.getvalue().count("rank  state") == 1  # throttled by text_interval
    handle.emit(0, "state", state="finished")
    handle.emit(1, "state", state="failed")
    assert monitor.finished
    printed = out.getvalue()
    assert printed.count("rank  state") == 2 and "failed" in printed  # the final table, once
    handle.emit(1, "log", step=6, values={})
    assert out.getvalue() == printed
    monitor.detach()
    assert handle.listeners == []


def test_widget_view_renders_table_and_progress_bar():
    pytest.importorskip("ipywidgets")
    handle = FakeHandle(ranks=(0,))
    monitor = RunMonitor(handle, widget=True, interval=0)
    handle.emit(0, "state", state="running")
    handle.emit(0, "log", step=2, values={"loss": 1.5})
    handle.emit(0, "progress", n=4, total=8, desc="train", unit="it", rate=None, closed=False)
    assert "<td style='padding:0 10px 0 0'>1.5</td>" in monitor._view.table.value
    assert "running" in monitor._view.table.value
    assert (monitor._view.bar.value, monitor._view.bar.max) == (4.0, 8.0)
    assert monitor._view.bar_label.value == "train: 4/8"
    bundle = monitor._repr_mimebundle_()
    assert WIDGET_MIME in bundle and "loss" in bundle["text/plain"]


def test_a_run_that_fails_or_is_stopped_is_drawn_so_bar_and_chart_title():
    pytest.importorskip("ipywidgets")
    handle = FakeHandle(ranks=(0, 1))
    handle.label, handle.started = "notebook_launcher(train)", 0.0
    monitor = RunMonitor(handle, widget=True, interval=0)
    handle.emit(0, "state", state="running")
    handle.emit(1, "state", state="running")
    handle.emit(0, "log", step=1, values={"loss": 2.0})
    handle.emit(0, "progress", n=81, total=200, desc="train", unit="it", rate=None, closed=False)
    assert monitor._view.bar.bar_style == ""
    handle.emit(1, "state", state="failed")
    handle.emit(0, "state", state="terminated")
    assert monitor._view.bar.bar_style == "danger"  # not a green bar frozen at 81/200
    assert monitor._view.bar_label.value == "train: 81/200 (failed)"
    assert 'class="nbaccel-title"' in monitor.final_svg
    assert monitor.final_svg.count("run 1: notebook_launcher(train), started ") == 1
    assert ", failed</text>" in monitor.final_svg


def test_bursts_of_events_are_merged_and_the_last_one_is_drawn():
    handle = FakeHandle(ranks=(0,))
    monitor = RunMonitor(handle, widget=False, stream=None, interval=0.3)
    draws = []
    original = monitor.refresh

    def counting_refresh():
        draws.append(time.monotonic())
        original()

    monitor.refresh = counting_refresh
    for step in range(50):
        handle.emit(0, "log", step=step, values={"loss": float(step)})
    assert len(draws) <= 1
    time.sleep(0.6)  # the deferred redraw fires once the quiet period ends
    assert 1 <= len(draws) <= 2
    assert monitor.rows()[1][2:] == ["49", "49"]


def _train_and_log(steps: int) -> dict:
    from nbaccel import Accelerator

    accelerator = Accelerator()
    for step in range(steps):
        accelerator.log({"loss": 1.0 / (step + 1), "rank": accelerator.process_index}, step=step)
        time.sleep(0.02)
    return {"rank": accelerator.process_index, "steps": steps}


@pytest.mark.integration
def test_monitor_follows_a_real_non_blocking_launch():
    from nbaccel import notebook_launcher

    lines: list[tuple[int, str, str]] = []
    handle = notebook_launcher(
        _train_and_log,
        args=(20,),
        num_processes=2,
        block=False,
        output=lambda rank, stream, line: lines.append((rank, stream, line)),
    )
    assert not handle.done()  # returned while the workers run (the job sleeps 20 x 20 ms)
    out = io.StringIO()
    monitor = watch(handle, widget=False, stream=out, interval=0)
    assert handle.result(timeout=120) == {"rank": 0, "steps": 20}
    deadline = time.monotonic() + HANG_GUARD_S
    while not monitor.finished and time.monotonic() < deadline:
        time.sleep(0.05)
    rows = monitor.rows()
    assert rows[0][:3] == ["rank", "state", "step"] and "loss" in rows[0]
    assert [r[:3] for r in rows[1:]] == [["0", "finished", "19"], ["1", "finished", "19"]]
    loss = rows[0].index("loss")
    assert rows[1][loss] == rows[2][loss] == "0.05"
    assert "finished" in out.getvalue()


# ------------------------------------------------------------------ in a real kernel
KERNEL_SETUP = textwrap.dedent(
    """
    import os, time
    import torch
    from nbaccel import Accelerator, notebook_launcher, tqdm
    from nbaccel.monitor import watch

    def train(steps, pause):
        accelerator = Accelerator()
        for step in tqdm(range(steps), desc="train"):
            accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
            time.sleep(pause)
        return torch.tensor([accelerator.process_index, os.getpid()])

    def forever():
        Accelerator()
        while True:
            time.sleep(0.1)
    """
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    pytest.importorskip("ipywidgets")
    from kernel_harness import module_kernel

    yield from module_kernel(tmp_path_factory, KERNEL_SETUP)


@pytest.mark.kernel
@pytest.mark.integration
def test_block_false_keeps_the_kernel_responsive_and_returns_rank0_value(kernel):
    with kernel.watch_descendants() as seen:
        cell = kernel.execute(
            "t0 = time.monotonic()\n"
            "handle = notebook_launcher(train, args=(40, 0.1), num_processes=2, block=False)\n"
            "monitor = watch(handle)\n"
            "print(f'returned after {time.monotonic() - t0:.2f}s')",
            timeout=60,
        ).raise_for_error()
        returned_after = float(cell.stdout.split("returned after ")[1].split("s")[0])
        assert returned_after < 3, cell.describe()
        assert cell.displays(WIDGET_MIME), cell.describe()

        # another cell runs while the workers train
        cell = kernel.execute("print(6 * 7, handle.done())", timeout=10).raise_for_error()
        assert cell.stdout.startswith("42 False"), cell.describe()
        assert kernel.evaluate("sorted(s['state'] for s in handle.status().values())") in (
            "['running', 'running']",
            "['running', 'starting']",
            "['starting', 'starting']",
        )

        value = kernel.evaluate_json(
            "(lambda v: [int(v[0]), int(v[1]), handle.pids[0]])(handle.result(timeout=120))",
            timeout=150,
        )
        assert value[0] == 0 and value[1] == value[2]  # rank 0's tensor, from rank 0's process
        text = kernel.evaluate("monitor.text()")
        assert "finished" in text and "39" in text and "train: 40/40" in text
    assert len(seen) >= 2
    kernel.assert_no_descendants(timeout=5)


@pytest.mark.kernel
@pytest.mark.integration
def test_stop_terminates_every_worker(kernel):
    kernel.run(
        "h = notebook_launcher(forever, num_processes=2, block=False)\n"
        "deadline = time.monotonic() + 600\n"  # a hang guard, as every wait here
        "while not all(h.pids.values()) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)",
        timeout=90,
    )
    pids = kernel.evaluate_json("list(h.pids.values())")
    assert len(pids) == 2 and all(pids)
    workers = [psutil.Process(pid) for pid in pids]
    kernel.run("t0 = time.monotonic(); h.stop(); stop_took = time.monotonic() - t0", timeout=30)
    assert kernel.evaluate_json("h.done()") is True
    assert kernel.evaluate_json("stop_took") < 10
    states = kernel.evaluate_json("sorted(s['state'] for s in h.status().values())")
    assert set(states) <= {"stopped", "terminated", "killed"}, states
    from kernel_harness import wait_gone

    assert not wait_gone(workers, timeout=HANG_GUARD_S)
    kernel.assert_no_descendants(timeout=5)
    # the handle reports why it ended
    assert "Stopped" in kernel.evaluate("type(h.exception()).__name__")


def test_pending_redraw_runs_on_one_reused_daemon_thread_and_detach_cancels_it():
    handle = FakeHandle(ranks=(0,))
    monitor = RunMonitor(handle, widget=False, stream=None, interval=0.2)
    draws = []
    original = monitor.refresh
    monitor.refresh = lambda: draws.append(time.monotonic()) or original()
    threads = set()
    for burst in range(3):
        for step in range(20):
            handle.emit(0, "log", step=burst * 100 + step, values={"x": 1.0})
        threads.add(monitor._redraw._thread)
        time.sleep(0.4)
    (thread,) = threads  # not a thread per quiet period
    assert thread.daemon and thread.is_alive() and thread.name == "nbaccel-monitor"
    assert 3 <= len(draws) <= 6
    handle.emit(0, "log", step=1000, values={"x": 1.0})
    assert monitor._redraw.pending
    monitor.detach()
    assert not monitor._redraw.pending
    drawn = len(draws)
    time.sleep(0.4)
    assert len(draws) == drawn  # cancelled


# ------------------------------------------------------------------ charts, stragglers, log
class FakeCell:
    """The part of a launch's CellOutput the monitor uses: who takes the lines."""

    def __init__(self):
        self.listener = None

    def set_listener(self, listener):
        self.listener = listener


def test_charts_follow_logged_values_and_are_left_as_an_image_when_the_run_ends():
    handle = FakeHandle()
    monitor = RunMonitor(handle, widget=False, stream=None, interval=0, chart_interval=0)
    for rank in (0, 1):
        handle.emit(rank, "state", state="running")
    for step in range(20):
        for rank in (0, 1):
            handle.emit(rank, "log", step=step, values={"loss": 1.0 / (step + 1) + rank})
    data = monitor.chart_data()
    assert list(data) == ["loss"] and sorted(data["loss"]) == [0, 1]
    assert data["loss"][1][-1] == (19.0, 1.05)
    assert monitor.final_svg is None  # still running
    handle.emit(0, "state", state="finished")
    handle.emit(1, "state", state="finished")
    svg = monitor.final_svg
    assert svg is not None and svg.count("<polyline") == 2 and 'data-metric="loss"' in svg


def test_charts_redraw_at_a_bounded_rate_whatever_the_logging_rate():
    pytest.importorskip("ipywidgets")
    handle = FakeHandle(ranks=(0,))
    monitor = RunMonitor(handle, widget=True, interval=0, chart_interval=0.5)
    drawn = []
    original = monitor.chart_svg
    monitor.chart_svg = lambda: drawn.append(time.monotonic()) or original()
    handle.emit(0, "state", state="running")
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < 1.2:
        handle.emit(0, "log", step=step, values={"loss": float(step)})
        step += 1
    assert step > 100
    assert 1 <= len(drawn) <= 4, drawn  # ~ every 0.5 s, not once per event
    time.sleep(0.7)  # the last values are drawn once the interval has passed
    assert monitor._view.charts.value == monitor.chart_svg()  # the last values are shown
    monitor.detach()


def test_system_charts_are_opt_in_and_stragglers_are_marked():
    handle = FakeHandle(ranks=(0, 1, 2))
    monitor = RunMonitor(handle, widget=False, stream=None, interval=0, system=True)
    plain = RunMonitor(handle, widget=False, stream=None, interval=0)
    for rank in (0, 1, 2):
        handle.emit(rank, "state", state="running")
    for window in range(4):
        for rank, busy in ((0, 0.02), (1, 0.021), (2, 0.3)):
            handle.emit(rank, "system", updates=window * 5, step_time=0.3, busy=busy, rss=2**28)
    assert list(monitor.chart_data()) == ["step time (s)", "RSS (MiB)"]
    assert plain.chart_data() == {}
    assert list(monitor.stragglers()) == [2]
    assert "straggler: rank 2 (busy 0.3 s/step vs 0.0205 s on the other ranks)" in monitor.text()
    handle.emit(2, "state", state="finished")
    assert monitor.stragglers() == {}  # only running ranks are marked


def test_the_log_takes_over_the_run_output_and_gives_it_back():
    pytest.importorskip("ipywidgets")
    handle = FakeHandle(ranks=(0,))
    handle.cell_output = FakeCell()
    monitor = RunMonitor(handle, widget=True, interval=0, log_lines=3)
    listener = handle.cell_output.listener
    assert listener is not None
    listener("line", "stdout", "[rank0] one\n[rank0] two\n")
    listener("line", "stderr", "[rank0] oops\n")
    listener("redraw", "stderr", "[rank0] steps:  50%|#####     | 5/10")
    html_log = monitor._view.log.value
    assert "nbaccel-live-line" in html_log and "50%" in html_log
    listener("redraw-end", "stderr", "[rank0] steps: 100%|##########| 10/10")
    listener("line", "stdout", "[rank0] done\n")
    assert monitor.log() == "[rank0] oops\n[rank0] steps: 100%|##########| 10/10\n[rank0] done\n"
    assert "50%" not in monitor._view.log.value  # bounded: only the last 3 lines
    monitor.detach()
    assert handle.cell_output.listener is None


def test_a_fast_bars_text_that_came_before_its_events_leaves_the_log():
    pytest.importorskip("ipywidgets")
    handle = FakeHandle(ranks=(0,))
    handle.cell_output = FakeCell()
    monitor = RunMonitor(handle, widget=True, interval=0)
    listener = handle.cell_output.listener
    listener("line", "stdout", "[rank0] before\n")
    listener("redraw-end", "stderr", "[rank0] fast: 100%|##########| 3/3")  # pipe first...
    handle.emit(0, "progress", n=3, total=3, desc="fast", unit="it", rate=None, closed=True)
    assert monitor.log() == "[rank0] before\n"  # ...then its events: drawn once, as the bar
    assert monitor._view.bar.bar_style == "success"


def test_stacks_come_from_the_handle():
    handle = FakeHandle(ranks=(0, 1))
    handle.stacks = lambda ranks=None: {
        r: f'File "cell", line {r} in train' for r in ranks or (0, 1)
    }
    monitor = RunMonitor(handle, widget=False, stream=None)
    assert monitor.stacks([1]) == {1: 'File "cell", line 1 in train'}
    assert RunMonitor(FakeHandle(), widget=False, stream=None).stacks() == {}


def test_a_pool_monitor_starts_afresh_with_each_call():
    handle = FakeHandle(ranks=(0,))
    handle._status[0]["state"] = "idle"
    monitor = RunMonitor(handle, widget=False, stream=None, interval=0, chart_interval=0)
    for call in range(2):
        handle.emit(0, "state", state="running")
        for step in range(3):
            handle.emit(0, "log", step=step, values={f"loss{call}": 1.0})
        handle.emit(0, "state", state="idle")
        assert list(monitor.chart_data()) == [f"loss{call}"]
        assert f'data-metric="loss{call}"' in monitor.final_svg


def test_a_monitor_opened_late_still_charts_from_the_first_step():
    from nbaccel.launch.handle import RankStatus

    board = RankStatus([0, 1], "running")

    class Handle:  # a LaunchHandle's board: it keeps the logged values for late listeners
        status = board.snapshot
        add_listener = board.add_listener
        remove_listener = board.remove_listener

    for step in range(5):
        board.publish(step % 2, "log", {"step": step, "values": {"loss": float(step)}})
    board.publish(0, "progress", {"n": 1})  # not replayed: only logged values are
    monitor = RunMonitor(Handle(), widget=False, stream=None, interval=0)
    board.publish(1, "log", {"step": 5, "values": {"loss": 5.0}})
    data = monitor.chart_data()["loss"]
    assert [x for x, _ in data[0]] == [0, 2, 4] and [x for x, _ in data[1]] == [1, 3, 5]
    assert monitor._progress == {}


def test_lines_read_after_the_run_ended_reach_the_saved_copy():
    """A worker's last lines come through its pipe, its end through the channel: the
    lines may be read after the end was drawn (a loaded CI run lost '[rank0] done')."""
    handle = FakeHandle(ranks=(0,))
    monitor = RunMonitor(handle, widget=False, stream=None, interval=0, chart_interval=0)
    updates = []

    class Cell:
        def update(self, display_id, bundle):
            updates.append(bundle)

    monitor._cell, monitor._live.shown_in = Cell(), "the launching cell"
    handle.emit(0, "state", state="running")
    monitor._on_output("line", "stdout", "[rank0] step 1\n")
    handle.emit(0, "state", state="finished")
    assert "[rank0] step 1" in updates[-1]["text/plain"]
    monitor._on_output("line", "stdout", "[rank0] done\n")  # read after the end
    assert "[rank0] done" in updates[-1]["text/plain"], updates[-1]
