"""One launch engine, and what is built on it.

* the engine: ``_preflight`` (+ ``_safety``) checks and resolves before anything starts;
  ``_start`` starts a group (``_rendezvous``, ``_process``: fork or spawn, ``_preload``);
  each worker runs ``_worker``'s loop (``_jobs``, ``_worker_os``, ``_agreement``); one
  channel per worker (``_wire``); one supervisor (``_supervisor`` over ``_group``, with
  ``_failures``, ``_output``, ``_status``); TPUs start through ``_xla``;
* :mod:`~nbaccel.launch.launcher` -- ``notebook_launcher`` (one job), ``debug_launcher``,
  ``run_script`` (``nbaccel launch``); :mod:`~nbaccel.launch.handle` -- ``LaunchHandle``;
* :mod:`~nbaccel.launch.pool` -- ``start_workers``/``WorkerPool`` (many jobs; ``_pool``);
  :mod:`~nbaccel.launch.magic` -- ``%%distributed``;
* :mod:`~nbaccel.launch.testing` -- ``run_on_workers`` for tests, through this engine.
"""
