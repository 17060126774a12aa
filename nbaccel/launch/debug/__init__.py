"""Debugging plugged into the engine: the hang watchdog, and failed ranks kept for pdb.

``_watchdog`` (ranks waiting on each other without progress are reported) and ``_kept``
(which failed job's ranks can still be debugged; the door is :mod:`..debugger`, the worker
side is ``worker/_postmortem``). Both are supervisor hooks.
"""
