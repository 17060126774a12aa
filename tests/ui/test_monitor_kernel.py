"""Issue 28 in a real kernel: the live monitor's charts, its final image, stragglers.

Every cell runs in a real IPython kernel through jupyter_client; the workers are real
2-process gloo launches. Output is told apart by each message's parent header, as a
notebook front end does; messages that arrive after their cell finished are kept
(``KernelSession.drain``).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

SETUP = textwrap.dedent(
    """
    import time
    import torch
    from nbaccel import Accelerator, notebook_launcher, start_workers
    from nbaccel.monitor import watch

    def train(steps, slow_rank=None, pause=0.0):
        accelerator = Accelerator()
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        gen = torch.Generator().manual_seed(accelerator.process_index)
        losses = []
        for step in range(steps):
            if accelerator.process_index == slow_rank:
                time.sleep(pause)  # a straggler: slow outside the backward pass
            x = torch.randn(16, 8, generator=gen)
            loss = (model(x) - 1).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": loss.item()}, step=step)
            losses.append(loss.item())
            time.sleep(0.02)
        print("done", flush=True)
        return losses
    """
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    pytest.importorskip("ipywidgets")
    from kernel_harness import module_kernel

    yield from module_kernel(tmp_path_factory, SETUP)


def test_watch_draws_the_charts_and_leaves_the_final_image_in_the_cell(kernel):
    launch = kernel.run(
        "handle = notebook_launcher(train, args=(30,), num_processes=2, block=False,\n"
        "                           return_all_ranks=True)\n"
        "monitor = watch(handle, system=True)",
        timeout=60,
    )
    live = kernel.run(
        "deadline = time.monotonic() + 600\n"
        "while len(monitor.chart_data().get('loss', {})) < 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print('live', sorted(monitor.chart_data()['loss']), handle.done())",
        timeout=90,
    )
    losses = kernel.evaluate_json("handle.result(timeout=120)", timeout=150)
    kernel.drain(1.5)
    assert live.stdout == "live [0, 1] False\n", live.describe()  # charted while running
    data = kernel.evaluate_json(
        "{k: {r: v for r, v in d.items()} for k, d in monitor.chart_data().items()}"
    )
    assert list(data) == ["loss", "step time (s)", "RSS (MiB)"]
    for rank in (0, 1):  # every logged value, at its step, per rank
        assert data["loss"][str(rank)] == [[float(s), v] for s, v in enumerate(losses[rank])]
    assert data["RSS (MiB)"]["0"][-1][1] > 10
    # the cell: the live widget, then the final charts as a static image (saved notebooks)
    assert launch.displays(WIDGET_MIME), launch.describe()
    images = launch.displays("image/svg+xml")
    assert len(images) == 1, launch.describe()
    svg = images[0]["image/svg+xml"]
    assert re.findall(r'data-metric="([^"]+)"', svg) == list(data)
    assert svg.count('data-rank="0"') == 3 and svg.count('data-rank="1"') == 3
    assert kernel.evaluate_json("monitor.final_svg") == svg
    # the run's lines went to the monitor's log, not into the cell or a later one
    assert launch.streams == {} and live.stdout.count("[rank") == 0, launch.describe()
    log = kernel.evaluate_json("monitor.log()")
    assert "[rank0] done\n" in log and "[rank1] done\n" in log
    # saved and reopened (no kernel, no widget state): what the front end keeps is plain
    # outputs -- the monitor's last state with every line it logged, and the charts
    kept = saved(launch)
    assert not [out for out in kept if WIDGET_MIME in out], kept
    assert len(kept) == 2 and "image/svg+xml" in kept[1], kept
    for mime in ("text/plain", "text/html"):
        assert "[rank0] done" in kept[0][mime] and "[rank1] done" in kept[0][mime], kept[0]
    assert "finished" in kept[0]["text/plain"]


def saved(cell) -> list[dict]:
    """The cell's outputs as a notebook saves them: each display id holds its last update."""
    kept: list[dict] = []
    where: dict[str, int] = {}
    for out in cell.outputs:
        display_id = out.get("transient", {}).get("display_id")
        if out["msg_type"] == "update_display_data":
            if display_id in where:
                kept[where[display_id]] = out["data"]
        elif out["msg_type"] in ("display_data", "execute_result"):
            if display_id:
                where[display_id] = len(kept)
            kept.append(out["data"])
    return kept


def test_a_straggler_is_marked_and_its_stack_shown(kernel):
    kernel.run(
        "handle = notebook_launcher(train, args=(200, 1, 0.15), num_processes=2, block=False)\n"
        "monitor = watch(handle)",
        timeout=60,
    )
    try:
        kernel.run(
            "deadline = time.monotonic() + 600\n"
            "marks = []\n"
            "while not marks and time.monotonic() < deadline:\n"
            "    marks = list(monitor.stragglers())\n"
            "    time.sleep(0.1)",
            timeout=90,
        )
        assert kernel.evaluate_json("marks") == [1]
        why = kernel.evaluate_json("monitor.stragglers()[1]")
        assert why.startswith("busy "), why
        assert "straggler: rank 1" in kernel.evaluate_json("monitor.text()")
        shown = kernel.run(  # the widget's table shows it at its next redraw
            "deadline = time.monotonic() + 600\n"
            "while 'straggler: ' not in monitor._view.table.value and time.monotonic() < deadline:\n"
            "    time.sleep(0.05)\n"
            "print(monitor._view.table.value)",
            timeout=30,
        )
        assert "&#9888; straggler: busy" in shown.stdout, shown.describe()
        stacks = kernel.evaluate_json("{str(r): s for r, s in monitor.stacks().items()}")
        assert sorted(stacks) == ["0", "1"]
        assert re.search(r'File "[^"]*ipykernel[^"]*", line \d+, in train', stacks["1"]), stacks
        assert "_worker.py" not in stacks["1"]  # nbaccel's own frames are cut
    finally:
        kernel.run("handle.stop()", timeout=60)
    kernel.assert_no_descendants(timeout=10)


def test_one_monitor_one_chart_image_titled_by_run_and_a_stop_drawn_as_such(kernel):
    shown = kernel.run(  # watch() as the cell's last expression, as people write it
        "handle = notebook_launcher(train, args=(2000,), num_processes=2, block=False)\n"
        "watch(handle)",
        timeout=60,
    )
    kernel.run(
        "monitor = _\n"
        "deadline = time.monotonic() + 600\n"
        "while len(monitor.chart_data().get('loss', {})) < 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "handle.stop()",
        timeout=120,
    )
    kernel.drain(1.0)
    assert len(shown.displays(WIDGET_MIME)) == 1 and shown.result is None, shown.describe()
    images = shown.displays("image/svg+xml")
    assert len(images) == 1, shown.describe()
    title = re.search(r'class="nbaccel-title"[^>]*>([^<]*)<', images[0]["image/svg+xml"])
    assert title and title.group(1).startswith("run 1: notebook_launcher(train), started ")
    assert title.group(1).endswith(", stopped"), title.group(1)  # not drawn as a success
    kernel.assert_no_descendants(timeout=10)

    pool_cell = kernel.run("pool = start_workers(num_processes=2)\npm = watch(pool)", timeout=120)
    try:
        kernel.run("pool.run(train, 3)\npool.run(train, 4)", timeout=120)
        kernel.drain(1.0)
    finally:
        kernel.run("pool.close()", timeout=60)
    charts = [o for o in pool_cell.outputs if "image/svg+xml" in o["data"]]
    assert [o["msg_type"] for o in charts] == ["display_data", "update_display_data"], charts
    assert len({o["transient"]["display_id"] for o in charts}) == 1  # one set, replaced
    titles = [re.search(r"\((run \d+: .*)\)>$", o["data"]["text/plain"]) for o in charts]
    assert [t.group(1)[:22] for t in titles if t] == [
        "run 1: pool.call(train",
        "run 2: pool.call(train",
    ]
    assert all(t.group(1).endswith(", finished") for t in titles if t), titles
