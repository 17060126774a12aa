"""The GPU facts a launch decides on, read without initialising CUDA in the kernel.

Free notebook GPUs have traps that bite only once training runs: Kaggle's T4s
(compute capability 7.5) have no native bf16; two GPUs without NVLink can hang in NCCL's
peer-to-peer path (Lightning#19425); Docker's 64 MB ``/dev/shm`` breaks NCCL's
shared-memory transport (torchtitan#853). :func:`gpu_facts` reads what decides them:
compute capabilities and the peer-to-peer/NVLink topology from ``nvidia-smi`` (a
subprocess: the kernel's CUDA stays untouched, so forks stay possible), the size of
``/dev/shm`` from ``statvfs``. :func:`p2p_works` copies a tensor between two GPUs in a
subprocess, bounded in time. Both are the only sources of these facts: tests replace them.

Example:
    >>> GpuFacts().count, parse_matrix("GPU0 X OK\\nGPU1 OK X")
    (0, [['X', 'OK'], ['OK', 'X']])
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from . import environment


@dataclass(frozen=True)
class GpuFacts:
    """What the machine's GPUs can do, index by index as ``nvidia-smi`` counts them.

    Attributes:
        names: the GPUs' names.
        capabilities: each GPU's compute capability, ``(major, minor)``.
        p2p: ``p2p[i][j]``: the driver reports peer-to-peer reads from GPU i to GPU j.
        nvlink: ``nvlink[i][j]``: GPUs i and j are connected by NVLink.
        shm_bytes: the size of ``/dev/shm`` (None: unknown).
    """

    names: tuple[str, ...] = ()
    capabilities: tuple[tuple[int, int], ...] = ()
    p2p: tuple[tuple[bool, ...], ...] = ()
    nvlink: tuple[tuple[bool, ...], ...] = ()
    shm_bytes: int | None = None

    @property
    def count(self) -> int:
        return len(self.names)


def parse_matrix(text: str) -> list[list[str]]:
    """The GPU-by-GPU cells of ``nvidia-smi topo -m`` or ``topo -p2p r`` (rows ``GPUi``).

    Example:
        >>> parse_matrix("\\tGPU0\\tGPU1\\nGPU0\\tX\\tNV4\\nGPU1\\tNV4\\tX\\n")
        [['X', 'NV4'], ['NV4', 'X']]
    """
    rows = []
    for line in text.splitlines():
        cells = line.split()  # the header names the GPUs (then "CPU Affinity"...), a row cells
        is_gpu = bool(cells) and cells[0].startswith("GPU") and cells[0][3:].isdigit()
        if is_gpu and (len(cells) == 1 or not cells[1].startswith(("GPU", "CPU"))):
            rows.append(cells[1:])
    return [row[: len(rows)] for row in rows]


def _smi(*args: str) -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        return subprocess.run(
            [smi, *args], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def shm_size(path: str = "/dev/shm") -> int | None:
    """Bytes of the shared-memory file system (None: there is none)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


@functools.cache
def gpu_facts() -> GpuFacts:
    """The machine's GPU facts, read once per process; nothing at all without a driver.

    Example:
        >>> gpu_facts().count >= 0
        True
    """
    return read_gpu_facts(need_driver=True)


def read_gpu_facts(*, need_driver: bool) -> GpuFacts:
    """The machine's GPU facts, read now. ``need_driver``: none without the NVIDIA driver's
    files (no ``nvidia-smi`` subprocess there: a launch pays nothing); False asks whatever
    ``nvidia-smi`` the ``PATH`` finds (a cluster's node, read once per node)."""
    if need_driver and not any(os.path.exists(p) for p in environment._NVIDIA_DRIVER_FILES):
        return GpuFacts(shm_bytes=shm_size())
    names, capabilities = [], []
    for line in _smi("--query-gpu=name,compute_cap", "--format=csv,noheader").splitlines():
        name, _, cap = line.rpartition(",")
        major, _, minor = cap.strip().partition(".")
        if name.strip() and major.isdigit():
            names.append(name.strip())
            capabilities.append((int(major), int(minor or 0)))
    p2p = [[c == "OK" for c in row] for row in parse_matrix(_smi("topo", "-p2p", "r"))]
    links = [[c.startswith("NV") for c in row] for row in parse_matrix(_smi("topo", "-m"))]
    return GpuFacts(tuple(names), tuple(capabilities), tuple(map(tuple, p2p)),
                    tuple(map(tuple, links)), shm_size())  # fmt: skip


_P2P_CHECK = """
import sys, torch
a, b = (int(x) for x in sys.argv[1:3])
if a != b and not (torch.cuda.can_device_access_peer(a, b)
                   and torch.cuda.can_device_access_peer(b, a)):
    sys.exit(3)
x = torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{a}")
y = x.to(f"cuda:{b}")
z = y.to(f"cuda:{a}")
torch.cuda.synchronize(a); torch.cuda.synchronize(b)
sys.exit(0 if torch.equal(x, z) and torch.equal(x.cpu(), y.cpu()) else 4)
"""


def p2p_works(pairs: list[tuple[int, int]], timeout: float = 30.0) -> bool:
    """Whether a tensor copied GPU to GPU over the peer path arrives whole, for every pair
    (GPU indices as ``nvidia-smi`` numbers them), in one subprocess each (this process's
    CUDA stays untouched), ``timeout`` seconds at most: a hang is a failure.

    Example:
        >>> p2p_works([])
        True
    """
    for a, b in pairs:  # nvidia-smi's numbers are PCI bus order; CUDA's need not be
        visible = f"{a},{b}" if a != b else str(a)  # (a, a): the copy within one GPU
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=visible)
        indices = ["0", "1" if a != b else "0"]
        try:
            done = subprocess.run([sys.executable, "-c", _P2P_CHECK, *indices], env=env,
                                  capture_output=True, timeout=timeout)  # fmt: skip
        except (OSError, subprocess.SubprocessError):  # a hang included
            return False
        if done.returncode != 0:
            return False
    return True


__all__ = ["GpuFacts", "gpu_facts", "p2p_works", "parse_matrix", "read_gpu_facts", "shm_size"]
