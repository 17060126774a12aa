"""nbaccel.tqdm: a widget in a real kernel, text in a terminal, silent on non-main ranks."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest

import nbaccel
from nbaccel.tracking import progress

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

SCRIPT = textwrap.dedent(
    """
    import sys
    from nbaccel import tqdm
    for _ in tqdm(range(5), desc="work", main_process_only={main_only}):
        pass
    print("done", flush=True)
    """
)


def _run_script(env_extra: dict[str, str], main_only: bool = True) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(main_only=main_only)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_terminal_bar_is_text():
    proc = _run_script({})
    assert proc.stdout == "done\n"
    assert "work: 100%" in proc.stderr and "5/5" in proc.stderr
    assert "widget" not in proc.stderr.lower()


def test_non_main_rank_draws_nothing_unless_asked():
    assert _run_script({"RANK": "1", "WORLD_SIZE": "2"}).stderr == ""
    drawn = _run_script({"RANK": "1", "WORLD_SIZE": "2"}, main_only=False)
    assert "work: 100%" in drawn.stderr


def test_public_names_and_old_positional_flag(monkeypatch):
    assert nbaccel.tqdm is progress.tqdm
    monkeypatch.setattr(progress, "_rank", lambda: 1)
    assert progress.tqdm(range(2), file=io.StringIO()).disable  # rank 1: silent
    # the best-known peer's old signature: tqdm(main_process_only, iterable, ...)
    bar = progress.tqdm(False, range(2), file=io.StringIO())
    assert not bar.disable and list(bar) == [0, 1]
    assert list(progress.trange(1, 4, file=io.StringIO())) == [1, 2, 3]


def test_redraws_are_published_for_the_live_view(monkeypatch, request):
    events = []

    def publish(kind, **data):
        events.append((kind, data))

    from nbaccel.tracking import events as channel

    channel.install_sink(lambda kind, data: publish(kind, **data))
    request.addfinalizer(lambda: channel.install_sink(None))
    monkeypatch.setattr(progress, "_rank", lambda: 0)

    for _ in progress.tqdm(range(4), desc="epoch", file=io.StringIO(), mininterval=0):
        pass
    channel.flush()  # events are batched (at most FLUSH_S in the queue)
    kinds = {kind for kind, _ in events}
    assert kinds == {"progress"}
    last = events[-1][1]
    assert last["closed"] is True and last["n"] == 4 and last["total"] == 4
    assert last["desc"] == "epoch"


@pytest.mark.kernel
def test_kernel_bar_is_a_widget_and_forked_child_falls_back_to_text(tmp_path):
    pytest.importorskip("ipywidgets")
    from kernel_harness import KernelSession, isolated_env

    with KernelSession(cwd=tmp_path, env=isolated_env(tmp_path)) as kernel:
        cell = kernel.execute(
            "from nbaccel import tqdm\nfor _ in tqdm(range(3), desc='kernel'):\n    pass",
            timeout=120,
        ).raise_for_error()
        assert cell.displays(WIDGET_MIME), cell.describe()

        # A worker forked from the kernel cannot use the kernel's sockets: text there.
        cell = kernel.execute(
            textwrap.dedent(
                """
                import io, multiprocessing as mp
                from nbaccel.tracking import progress
                ctx = mp.get_context("fork")
                q = ctx.SimpleQueue()
                def child():
                    q.put((progress.in_kernel_process(), type(progress.tqdm(range(1))).__name__))
                p = ctx.Process(target=child); p.start(); p.join()
                print(q.get())
                """
            ),
            timeout=120,
        ).raise_for_error()
        assert cell.stdout.strip() == "(False, '_PublishingText')"
        assert not cell.displays(WIDGET_MIME)

        # rank 1 in a kernel (e.g. a multi-node session): no widget at all
        cell = kernel.execute(
            "import os; os.environ.update(RANK='1', WORLD_SIZE='2')\n"
            "for _ in tqdm(range(3)):\n    pass\n"
            "del os.environ['RANK'], os.environ['WORLD_SIZE']",
            timeout=60,
        ).raise_for_error()
        assert not cell.displays(WIDGET_MIME) and cell.stderr == ""
