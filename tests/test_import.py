"""Importing nbaccel is free of side effects (checked in fresh interpreters)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, logging, sys, threading
before_threads = threading.active_count()
root_handlers = list(logging.getLogger().handlers)
{imports}
torch_imported = "torch" in sys.modules
cuda_initialized = False
if torch_imported:
    import torch
    cuda_initialized = bool(torch.cuda.is_initialized())
loggers = [
    name for name, logger in logging.Logger.manager.loggerDict.items()
    if name.startswith("nbaccel") and getattr(logger, "handlers", None)
]
print(json.dumps({
    "threads": threading.active_count() - before_threads,
    "root_handlers_added": len(logging.getLogger().handlers) - len(root_handlers),
    "root_level": logging.getLogger().level,
    "nbaccel_loggers_with_handlers": loggers,
    "torch_imported": torch_imported,
    "cuda_initialized": cuda_initialized,
}))
"""


def _probe(imports: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.replace("{imports}", imports)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_nbaccel_is_cheap_and_silent():
    result = _probe("import nbaccel")
    assert result == {
        "threads": 0,
        "root_handlers_added": 0,
        "root_level": 30,
        "nbaccel_loggers_with_handlers": [],
        "torch_imported": False,  # torch is only imported when a public name needs it
        "cuda_initialized": False,
    }


def test_import_runtime_modules_initialises_no_cuda_thread_or_logging():
    result = _probe(
        "import nbaccel\n"
        "from nbaccel import Accelerator, DistributedType, ProcessState, set_seed\n"
        "import nbaccel.runtime.loading.data, nbaccel.runtime.collectives.ops, nbaccel.runtime.training.wrappers, nbaccel.runtime.training.accumulation, nbaccel.runtime.process.rng"
    )
    assert result["torch_imported"] is True
    assert result["cuda_initialized"] is False
    assert result["threads"] == 0
    assert result["root_handlers_added"] == 0 and result["root_level"] == 30
    assert result["nbaccel_loggers_with_handlers"] == []


def test_importing_nbaccel_patches_nothing_and_a_launch_installs_the_cuda_recorder():
    # importing has no side effect on torch; the first launch starts recording where CUDA
    # is first initialised (so a later refused fork can name the line), in either import order
    code = (
        "import sys, nbaccel\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "before = getattr(torch.cuda._lazy_init, '_nbaccel_cudatrace', False)\n"
        "hooks = [type(f).__name__ for f in sys.meta_path if 'Cuda' in type(f).__name__]\n"
        "from nbaccel.launch.testing import plan_for\n"
        "plan_for(print, num_processes=2, start_method='fork')\n"
        "print(before, hooks, getattr(torch.cuda._lazy_init, '_nbaccel_cudatrace', False))"
    )
    for order in (code, "import torch\n" + code.replace("assert 'torch' not", "assert 'torch'")):
        out = subprocess.run(
            [sys.executable, "-c", order], capture_output=True, text=True, timeout=120, check=True
        )
        assert out.stdout.strip() == "False [] True"
