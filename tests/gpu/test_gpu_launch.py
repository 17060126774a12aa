"""Launching onto real GPUs from a real IPython kernel.

Two kernels: one that never touches CUDA (fork must work there, and results with
CUDA tensors must arrive without initialising CUDA in it), and one where a cell
really initialises CUDA first (fork is refused naming that line; "auto" spawns).
Only public API is used: ``from nbaccel import ...``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from gpu_facts import gpu_count, skip_for_hardware
from kernel_harness import KernelSession, isolated_env

pytestmark = pytest.mark.gpu

SETUP = """
import os, sys, psutil, torch
from nbaccel import Accelerator, ConfigError, CUDAInitializedError, LaunchConfig
from nbaccel import notebook_launcher

FORKS = [0]  # every os.fork() made in the kernel: "nothing was forked" must be provable
os.register_at_fork(before=lambda: FORKS.__setitem__(0, FORKS[0] + 1))
GPUS = {gpus}


def where(tag):
    acc = Accelerator()
    t = torch.arange(4.0, device=acc.device) * (acc.process_index + 1)
    return {{
        "tag": tag,
        "rank": acc.process_index,
        "local_rank": acc.local_process_index,
        "world": acc.num_processes,
        "device": str(acc.device),
        "current_device": torch.cuda.current_device() if acc.device.type == "cuda" else None,
        "distributed_type": acc.distributed_type.value,
        "forked": "ipykernel_launcher" in " ".join(psutil.Process().cmdline()),
        "tensor": t,
        "param": torch.nn.Parameter(t.clone()),
        "nested": {{"t": [t * 2]}},
    }}


def summary(result):
    # what came back, seen from the kernel (JSON for the test)
    return {{
        **{{k: v for k, v in result.items() if k not in ("tensor", "param", "nested")}},
        "tensor_device": str(result["tensor"].device),
        "tensor": result["tensor"].tolist(),
        "param_type": type(result["param"]).__name__,
        "param_device": str(result["param"].device),
        "nested_device": str(result["nested"]["t"][0].device),
        "kernel_cuda_initialized": torch.cuda.is_initialized(),
    }}
"""


def _kernel(tmp_path_factory: pytest.TempPathFactory, name: str) -> KernelSession:
    workdir = tmp_path_factory.mktemp(name)
    session = KernelSession(cwd=workdir, env=isolated_env(workdir), startup_timeout=120)
    session.start()
    session.run(SETUP.format(gpus=gpu_count()), timeout=180)
    return session


@pytest.fixture(scope="module")
def clean_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    """A kernel that never initialises CUDA (nor loads the CUDA driver)."""
    session = _kernel(tmp_path_factory, "gpu-clean")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def cuda_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    """A kernel in which a cell of its own initialised CUDA."""
    session = _kernel(tmp_path_factory, "gpu-cuda")
    # its own cell, so the error can name "Cell In[n], line 1" and quote it
    session.run('marker = torch.zeros(1, device="cuda")', timeout=120)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def driver_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    """A kernel that asked torch.cuda.is_available(): the driver is loaded, CUDA not initialised."""
    session = _kernel(tmp_path_factory, "gpu-driver")
    session.run("available = torch.cuda.is_available()", timeout=120)
    yield session
    session.stop()


def _after(kernel: KernelSession) -> None:
    kernel.assert_no_descendants(timeout=10)


@pytest.mark.timeout(300)
def test_fork_launch_on_gpu_when_kernel_has_no_cuda(clean_kernel):
    clean_kernel.run(
        "forks_before = FORKS[0]\n"
        "h = notebook_launcher(where, args=('fork',), num_processes=1, start_method='fork',"
        " block=False)\n"
        "fork_result = summary(h.result(timeout=240))\n"
        "fork_result['forks'] = FORKS[0] - forks_before\n",
        timeout=280,
    )
    got = clean_kernel.evaluate_json("fork_result")
    assert got["forked"] is True and got["forks"] == 1, got
    assert got["device"] == "cuda:0" and got["current_device"] == 0, got
    # CUDA tensors were moved to the CPU in the worker: the kernel never touched CUDA
    assert got["tensor_device"] == "cpu" and got["tensor"] == [0.0, 1.0, 2.0, 3.0], got
    assert got["param_type"] == "Parameter" and got["param_device"] == "cpu", got
    assert got["nested_device"] == "cpu", got
    assert got["kernel_cuda_initialized"] is False, got
    _after(clean_kernel)


@pytest.mark.timeout(300)
def test_one_process_per_gpu(clean_kernel):
    clean_kernel.run(
        "h = notebook_launcher(where, args=('each',), num_processes=GPUS, block=False,"
        " return_all_ranks=True)\n"
        "each = [summary(r) for r in h.result(timeout=240)]\n",
        timeout=280,
    )
    each = clean_kernel.evaluate_json("each")
    gpus = gpu_count()
    assert [r["rank"] for r in each] == list(range(gpus)), each
    assert [r["device"] for r in each] == [f"cuda:{i}" for i in range(gpus)], each
    assert [r["current_device"] for r in each] == list(range(gpus)), each
    assert all(r["world"] == gpus for r in each), each
    kind = "MULTI_GPU" if gpus > 1 else "NO"
    assert all(r["distributed_type"] == kind for r in each), each
    assert [r["tensor"][1] for r in each] == [float(i + 1) for i in range(gpus)], each
    assert not any(r["kernel_cuda_initialized"] for r in each), each
    _after(clean_kernel)


TOO_MANY = """
forks_before = FORKS[0]
try:
    notebook_launcher(where, args=('too-many',), num_processes=GPUS + 1)
    too_many = ["no error", ""]
except ConfigError as err:
    too_many = [type(err).__name__, str(err)]
too_many.append(FORKS[0] - forks_before)
too_many.append(torch.cuda.is_initialized())
"""

CPU_ALTERNATIVE = """
def on_cpu():
    acc = Accelerator()
    import torch.distributed as dist
    return [str(acc.device), acc.num_processes, dist.get_backend()]

cpu_alt = notebook_launcher(on_cpu, num_processes=GPUS + 1,
                            config=LaunchConfig(compute_device="cpu"), return_all_ranks=True)
"""


@pytest.mark.timeout(300)
def test_more_processes_than_gpus_is_refused_before_anything_starts(clean_kernel):
    clean_kernel.run(TOO_MANY, timeout=120)
    kind, message, forks, cuda_init = clean_kernel.evaluate_json("too_many")
    gpus = gpu_count()
    assert kind == "ConfigError", message
    assert f"num_processes={gpus + 1}" in message and str(gpus) in message, message
    assert "compute_device='cpu'" in message and "gloo" in message, message
    assert forks == 0 and cuda_init is False
    _after(clean_kernel)
    # the alternative the message names really works: CPU processes over gloo
    clean_kernel.run(CPU_ALTERNATIVE, timeout=240)
    assert clean_kernel.evaluate_json("cpu_alt") == [["cpu", gpus + 1, "gloo"]] * (gpus + 1)
    _after(clean_kernel)


FORK_REFUSED = """
forks_before = FORKS[0]
try:
    notebook_launcher(where, args=('fork',), num_processes=1, start_method='fork', block=False)
    refused = ["no error", ""]
except CUDAInitializedError as err:
    refused = [type(err).__name__, str(err)]
refused.append(FORKS[0] - forks_before)
"""


@pytest.mark.timeout(300)
def test_fork_refused_after_real_cuda_init_naming_the_line(cuda_kernel):
    cuda_kernel.run(FORK_REFUSED, timeout=120)
    kind, message, forks = cuda_kernel.evaluate_json("refused")
    assert kind == "CUDAInitializedError", message
    assert forks == 0, "the launcher forked before refusing"
    # initialised before nbaccel watched (no launch yet): named from the kernel's history
    assert re.search(r"Cell In\[\d+\], line 1", message), message
    assert 'marker = torch.zeros(1, device="cuda")' in message, message
    assert "spawn" in message, message
    _after(cuda_kernel)


@pytest.mark.timeout(400)
def test_auto_spawns_after_real_cuda_init(cuda_kernel):
    cuda_kernel.run(
        "forks_before = FORKS[0]\n"
        "h = notebook_launcher(where, args=('auto',), num_processes=1, block=False)\n"
        "auto_result = summary(h.result(timeout=300))\n"
        "auto_result['forks'] = FORKS[0] - forks_before\n",
        timeout=360,
    )
    got = cuda_kernel.evaluate_json("auto_result")
    assert got["forked"] is False and got["forks"] == 0, got  # a fresh interpreter
    assert got["device"] == "cuda:0" and got["tensor_device"] == "cpu", got
    assert got["tensor"] == [0.0, 1.0, 2.0, 3.0] and got["param_type"] == "Parameter", got
    _after(cuda_kernel)


@pytest.mark.timeout(400)
def test_default_launch_uses_every_gpu(cuda_kernel):
    # num_processes=None: one process per GPU; with one GPU the function runs in the kernel
    # itself (no worker) and its value is returned as it is, on the GPU.
    cuda_kernel.run(
        "default = notebook_launcher(where, args=('default',), return_all_ranks=True)\n"
        "default = [summary(r) for r in default]\n",
        timeout=360,
    )
    got = cuda_kernel.evaluate_json("default")
    gpus = gpu_count()
    assert len(got) == gpus and got[0]["world"] == gpus, got
    assert [r["device"] for r in got] == [f"cuda:{i}" for i in range(gpus)], got
    if gpus == 1:
        assert got[0]["tensor_device"] == "cuda:0", got  # ran in this process
    else:
        assert all(r["tensor_device"] == "cpu" for r in got), got
    _after(cuda_kernel)


@pytest.mark.timeout(400)
def test_two_ranks_over_nccl_when_two_gpus_exist(clean_kernel):
    if gpu_count() < 2:
        skip_for_hardware("needs 2 GPUs for a 2-rank NCCL group; this machine has 1")
    clean_kernel.run(
        "def nccl_sum():\n"
        "    acc = Accelerator()\n"
        "    import torch.distributed as dist\n"
        "    t = torch.ones(1, device=acc.device) * (acc.process_index + 1)\n"
        "    acc.wait_for_everyone()\n"
        "    return [dist.get_backend(), acc.reduce(t).item()]\n"
        "nccl = notebook_launcher(nccl_sum, num_processes=2, start_method='fork')\n",
        timeout=360,
    )
    assert clean_kernel.evaluate_json("nccl") == ["nccl", 3.0]
    _after(clean_kernel)


DRIVER_LOADED = """
import warnings
state = {"available": available, "initialized": torch.cuda.is_initialized()}
forks_before = FORKS[0]
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    h = notebook_launcher(where, args=('auto',), num_processes=1, block=False)
    state["auto"] = summary(h.result(timeout=300))
state["auto_said"] = [str(w.message) for w in said]
state["auto_forks"] = FORKS[0] - forks_before
try:
    notebook_launcher(where, args=('fork',), num_processes=1, start_method='fork', block=False)
    state["fork"] = ["no error", ""]
except CUDAInitializedError as err:
    state["fork"] = [type(err).__name__, str(err)]
state["fork_forks"] = FORKS[0] - forks_before
"""


@pytest.mark.timeout(500)
def test_driver_loaded_by_is_available_makes_auto_spawn(driver_kernel):
    # torch.cuda.is_available() in a cell initialises the CUDA driver without torch's flag
    # (issue 32: on an H200 every forked child then failed with "Cannot re-initialize CUDA
    # in forked subprocess"): "auto" spawns and says why once, naming the line; an explicit
    # "fork" is refused before anything starts.
    driver_kernel.run(DRIVER_LOADED, timeout=460)
    got = driver_kernel.evaluate_json("state")
    assert got["available"] is True and got["initialized"] is False, got
    assert got["auto_forks"] == 0 and got["auto"]["forked"] is False, got
    assert got["auto"]["device"] == "cuda:0" and got["auto"]["tensor_device"] == "cpu", got
    said = [w for w in got["auto_said"] if "with spawn, not fork" in w]
    assert len(said) == 1 and "torch.cuda.is_available()" in said[0], got
    kind, message = got["fork"]
    assert kind == "CUDAInitializedError" and got["fork_forks"] == 0, got
    assert "available = torch.cuda.is_available()" in message, message
    _after(driver_kernel)


# Each state in a fresh interpreter; the guard's verdict, then a real forked child's first
# CUDA call: they must agree in every state (issue 32's list, measured on an H200).
STATES = {
    "import torch": "import torch",
    "device_count (NVML)": "import torch; torch.cuda.device_count()",
    "is_available": "import torch; torch.cuda.is_available()",
    "get_device_capability": "import torch; torch.cuda.get_device_capability()",
    "import torchao": "import torch, torchao",
    "cupy device count": "import torch, cupy; cupy.cuda.runtime.getDeviceCount()",
    "numba is_available": "import torch; from numba import cuda; cuda.is_available()",
    "import jax": "import torch, jax",
}
VERDICT = """
import os, sys, json
from nbaccel.platform import cudafork
from nbaccel import LaunchConfig
from nbaccel.launch.testing import plan_for
state = cudafork.fork_state()
try:  # CPU ranks: two of them pass the GPU count check on a 1-GPU machine
    plan_for(print, num_processes=2, start_method="fork",
             config=LaunchConfig(compute_device="cpu"))
    refused = False
except Exception as err:
    refused = type(err).__name__ == "CUDAInitializedError"
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        torch.zeros(1, device="cuda"); torch.cuda.synchronize(); os.write(w, b"ok")
    except Exception as err:
        os.write(w, str(err)[:200].encode())
    os._exit(0)
os.close(w); os.waitpid(pid, 0)
child = os.read(r, 1000).decode()
print(json.dumps({"broken": state.broken, "refused": refused, "child": child,
                  "torch_flag": torch.cuda.is_initialized()}))
"""


@pytest.mark.timeout(400)
def test_the_guard_agrees_with_a_real_forked_child_in_every_state():
    import importlib.util
    import json
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        name, setup = item
        top = setup.split("import ", 1)[1].split(",")[-1].split(";")[0].strip()
        if importlib.util.find_spec(top.split(".")[0]) is None:
            return name, None
        out = subprocess.run(
            [sys.executable, "-c", setup + "\n" + VERDICT],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = out.stdout.strip().splitlines()
        return name, json.loads(lines[-1]) if lines else {"error": out.stderr[-800:]}

    with ThreadPoolExecutor(4) as pool:
        got = dict(pool.map(one, STATES.items()))
    ran = {k: v for k, v in got.items() if v is not None}
    assert "is_available" in ran and "import torch" in ran, got
    for name, v in ran.items():
        assert "error" not in v, (name, v)
        assert v["broken"] is (v["child"] != "ok"), (name, v)  # the guard tells the truth
        assert v["refused"] is v["broken"], (name, v)  # and fork is refused exactly then
    assert ran["import torch"]["broken"] is False, got  # a mapped driver alone is fine
    assert ran["is_available"]["broken"] is True, got
    assert ran["is_available"]["torch_flag"] is False, got  # torch's flag did not say so
