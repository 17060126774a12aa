"""One launch engine in folders by concept, and the doors built on it.

The folders (docs/explanation/launch-layout.md; each one's ``__init__`` says its job):

* ``channel/`` -- what the kernel and a worker say and how it travels: ``_messages``,
  ``_wire``, ``_jobs``, ``_cluster_wire`` (authenticated TCP), ``_rendezvous``;
* ``cell/`` -- what the launching cell sees of the output: ``_output``, ``_cell_output``;
* ``worker/`` -- one worker's life: ``_worker``'s loop, ``_worker_os``, ``_postmortem``;
* ``engine/`` -- one supervisor over started workers: ``_supervisor``, ``_group`` (with the
  public names start backends use), ``_tidy``, ``_lifetimes``;
* ``debug/`` -- supervisor hooks: ``_watchdog`` (hangs), ``_kept`` (ranks kept for pdb);
* ``start/`` -- check, plan, start: ``_preflight``, ``_freegpus``, ``_start``, ``_local``
  (fork, spawn, fork server), ``_forkserver``, ``cluster/`` (Ray); on TPUs the backend sets
  each started worker up.

The doors, at the top:

* :mod:`~nbaccel.launch.launcher` -- ``notebook_launcher`` (one job), ``debug_launcher``,
  ``run_script`` (``nbaccel launch``); :mod:`~nbaccel.launch.handle` -- ``LaunchHandle``;
* :mod:`~nbaccel.launch.pool` -- ``start_workers``/``WorkerPool`` (many jobs);
  :mod:`~nbaccel.launch.magic` -- ``%%distributed``;
* :mod:`~nbaccel.launch.debugger` -- ``nbaccel.debug()``/``%nbaccel_debug``: pdb on a failed
  rank;
* :mod:`~nbaccel.launch.testing` -- ``run_on_workers`` for tests, through this engine.
"""
