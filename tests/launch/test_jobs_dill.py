"""What the kernel ships to spawned workers: a function that prints ships from a Ray driver."""

from __future__ import annotations

import builtins
import types

import pytest

from nbaccel.launch.channel._jobs import dill_for_workers


def test_a_function_that_prints_ships_after_ray_patched_print(monkeypatch):
    # Ray's driver swaps print for its tqdm's safe_print once it has shown a worker's log
    # line; dill then chased Ray's functions round a cycle: RecursionError, so every notebook
    # function that prints failed to reach spawned or cluster workers from such a kernel
    tqdm_ray = pytest.importorskip("ray.experimental.tqdm_ray")  # imported, Ray not started
    import dill

    monkeypatch.setattr(builtins, "print", tqdm_ray.safe_print)
    namespace: dict = {"__name__": "__main__"}
    exec("def shout(word):\n    print(word)\n    return word.upper()\n", namespace)
    payload = dill_for_workers((namespace["shout"], ("hi",), {}), "the function")
    assert builtins.print is tqdm_ray.safe_print  # the kernel's print is put back
    monkeypatch.setattr(builtins, "print", tqdm_ray._print)  # as in a worker: its own print
    function, args, _ = dill.loads(payload)
    assert isinstance(function, types.FunctionType) and function(*args) == "HI"
    assert function.__globals__.get("print", builtins.print) is tqdm_ray._print  # by name
