"""A stand-in CUDA driver (``libcuda.so.1``) for CPU machines, built with ``cc``.

It keeps the one property of the real driver that nbaccel's fork guard relies on: every
call but ``cuInit`` returns ``CUDA_ERROR_NOT_INITIALIZED`` (3) until ``cuInit`` has been
called in the process. ``stub_init_calls()`` counts the ``cuInit`` calls, so a test can
prove that nbaccel's own check never initialised the driver. Loaded with ctypes, it is
mapped as ``.../libcuda.so.1`` in ``/proc/self/maps``, as the real one is.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = r"""
static int initialised = 0, calls = 0;
int cuInit(unsigned int flags) { (void)flags; calls++; initialised = 1; return 0; }
int cuDeviceGetCount(int *count) {
    if (!initialised) return 3; /* CUDA_ERROR_NOT_INITIALIZED */
    *count = 1;
    return 0;
}
int stub_init_calls(void) { return calls; }
"""


def build_fake_driver(folder: Path) -> Path:
    """Compile the stand-in driver into ``folder/libcuda.so.1``; skip where no cc exists."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler (cc) to build the stand-in CUDA driver")
    source, library = folder / "fake_libcuda.c", folder / "libcuda.so.1"
    source.write_text(SOURCE)
    cmd = [cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(source)]
    subprocess.run(cmd, check=True, capture_output=True)
    return library
