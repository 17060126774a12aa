"""One launch engine, and what is built on it.

* the engine: ``_preflight`` checks and resolves before anything starts;
  ``_start`` starts a group (``_rendezvous``, ``_group``: fork or spawn);
  each worker runs ``_worker``'s loop (``_jobs``, ``_worker_os``); one
  channel per worker (``_wire``, its messages ``_messages``); one supervisor (``_supervisor`` over ``_group``, with
  ``_tidy``, ``_output``, and ``_watchdog``: ranks waiting on each other
  without progress are reported); on TPUs the backend sets each started worker up;
* :mod:`~nbaccel.launch.launcher` -- ``notebook_launcher`` (one job), ``debug_launcher``,
  ``run_script`` (``nbaccel launch``); :mod:`~nbaccel.launch.handle` -- ``LaunchHandle``;
* :mod:`~nbaccel.launch.pool` -- ``start_workers``/``WorkerPool`` (many jobs);
  :mod:`~nbaccel.launch.magic` -- ``%%distributed``;
* :mod:`~nbaccel.launch.debugger` -- ``nbaccel.debug()``/``%nbaccel_debug``: pdb on a failed
  rank (worker side ``_postmortem``, the kernel's record of failed jobs ``_kept``);
* :mod:`~nbaccel.launch.testing` -- ``run_on_workers`` for tests, through this engine.
"""
