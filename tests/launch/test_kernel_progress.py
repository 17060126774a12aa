"""A plain ``from tqdm.auto import tqdm`` bar in the launched function shows in the cell.

In a kernel, ``tqdm.auto`` is the ipywidgets bar; in a worker forked from the kernel its
widget messages are dropped by ipykernel ("attempted to send message from fork"), so the
user saw no progress at all. The worker now draws rank 0's bar as text, which the
launcher forwards to the cell live, as one output updated in place.
"""

from __future__ import annotations

import textwrap

import pytest
from kernel_harness import KernelSession, isolated_env

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

CELL = textwrap.dedent(
    """
    import time
    from tqdm.auto import tqdm as bound_before_fork   # an earlier cell's import
    from nbaccel import Accelerator, notebook_launcher

    def train():
        from tqdm.auto import tqdm                      # the tutorials' import
        accelerator = Accelerator()
        for _ in tqdm(range(6), desc="plainbar", disable=not accelerator.is_local_main_process):
            time.sleep(0.05)
        for _ in bound_before_fork(range(4), desc="earlybar"):
            pass
        return accelerator.process_index

    print("ranks", notebook_launcher(train, num_processes=2))
    """
)


def bars(cell) -> dict[str, list[str]]:
    """Every in-place output of the cell: display id -> the texts it showed, in order."""
    shown: dict[str, list[str]] = {}
    for out in cell.outputs:
        display_id = out.get("transient", {}).get("display_id")
        if display_id and out["msg_type"] in ("display_data", "update_display_data"):
            shown.setdefault(display_id, []).append(out["data"]["text/plain"])
    return shown


def test_tqdm_auto_bar_in_workers_shows_in_the_cell(tmp_path):
    pytest.importorskip("ipywidgets")
    with KernelSession(cwd=tmp_path, env=isolated_env(tmp_path)) as kernel:
        cell = kernel.run(CELL, timeout=240)
        text = cell.stdout + cell.stderr
        assert "ranks 0" in cell.stdout, cell.describe()
        # each bar is one output updated in place (issue 28), never a stream line: JupyterLab
        # drew every "\r" redraw on stderr as a new pink line
        assert "plainbar" not in text and "earlybar" not in text, cell.describe()
        finals = [texts[-1] for texts in bars(cell).values()]
        assert len(finals) == 2, bars(cell)
        for (desc, total), final in zip((("plainbar", 6), ("earlybar", 4)), finals, strict=True):
            assert final.startswith(f"[rank0] {desc}: 100%") and f"{total}/{total}" in final
        plainbar = next(iter(bars(cell).values()))
        assert len(plainbar) >= 2 and plainbar[0] != plainbar[-1]  # updated, not re-added
