"""The worker: one process's life, from set-up through its jobs to its exit.

``_worker`` (the loop: set up, join the rendezvous, run jobs), ``_worker_os`` (output,
signals, dying with the supervisor, the main thread's stack) and ``_postmortem`` (pdb on a
failed job, served over the channel). Runs in the worker process; the kernel imports it
only for :class:`~.._worker.WorkerSpec` and the entry points a start backend calls.
"""
