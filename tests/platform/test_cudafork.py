"""The CUDA fork guard's facts (issue 32), on a CPU machine: a stand-in driver with the
real one's rule (tests/platform/fake_cuda.py) in a fresh interpreter; the kernel-facing
behaviour is in test_fork_warning_kernel.py, the real driver in tests/gpu."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

from fake_cuda import build_fake_driver

from nbaccel.platform import cudafork, cudatrace


def test_driver_state_is_read_without_initialising_it(tmp_path):
    library = build_fake_driver(tmp_path)
    code = textwrap.dedent(
        f"""
        import ctypes, json, warnings
        from nbaccel.platform import cudafork
        from nbaccel.launch.testing import plan_for
        nothing = [cudafork.mapped_driver(), cudafork.fork_state().broken]
        drv = ctypes.CDLL({str(library)!r})
        mapped = [cudafork.mapped_driver(), cudafork.fork_state().broken, drv.stub_init_calls()]
        drv.cuInit(0)
        state = cudafork.fork_state()
        try:
            plan_for(print, num_processes=2, start_method="fork")
            refused = None
        except Exception as err:
            refused = [type(err).__name__, str(err)]
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            auto = plan_for(print, num_processes=2).method
        print(json.dumps({{"nothing": nothing, "mapped": mapped, "after": [state.context,
            state.driver, drv.stub_init_calls()], "refused": refused, "auto": auto,
            "said": [str(w.message) for w in said]}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["nothing"] == [None, False], got  # no driver mapped: nothing to ask
    assert got["mapped"] == [str(library), False, 0], got  # mapped, not initialised, untouched
    assert got["after"] == [False, True, 1], got  # torch's flag says nothing; the driver does
    kind, message = got["refused"]
    assert kind == "CUDAInitializedError" and "CUDA driver is already initialised" in message
    assert got["auto"] == "spawn" and len(got["said"]) == 1, got


def test_the_cause_is_guessed_from_the_history_when_nbaccel_was_not_watching(monkeypatch):
    monkeypatch.setattr(cudatrace, "_first_init", None)
    monkeypatch.setattr(cudatrace, "_driver_first", None)
    monkeypatch.setattr(cudatrace, "_driver_cell", [])
    history = [
        "",
        "import torch",
        'x = 1\nmarker = torch.zeros(1, device="cuda")',
        "import torchao",
        'def later():\n    return torch.ones(1, device="cuda")',  # defined, never called
    ]
    shell = types.SimpleNamespace(user_ns={"In": history})
    monkeypatch.setattr(cudatrace, "_shell", lambda: shell)
    text = cudatrace.describe_cause(cudafork.CudaForkState(driver=True))
    assert "not watching yet" in text, text
    assert "Cell In[2], line 2" in text and 'marker = torch.zeros(1, device="cuda")' in text
    assert "Cell In[3], line 1" in text and "import torchao" in text, text
    assert "Cell In[1]" not in text, text  # `import torch` alone does not initialise CUDA
    assert "Cell In[4]" not in text, text  # a function's body runs only when it is called
    shell.user_ns["In"] = ["", "import torch"]
    assert "unknown" in cudatrace.describe_cause(cudafork.CudaForkState(context=True))
