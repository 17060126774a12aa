"""Alias of :mod:`nbaccel.launch.launcher`, kept so ``import nbaccel.launcher`` still works."""

from .launch.launcher import LaunchHandle, WorkerTimeoutError, debug_launcher, notebook_launcher

__all__ = ["LaunchHandle", "WorkerTimeoutError", "debug_launcher", "notebook_launcher"]
