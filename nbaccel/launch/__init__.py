"""Starting and supervising workers from the kernel (the kernel's side of the fork).

* :mod:`~nbaccel.launch.launcher` -- ``notebook_launcher`` and ``debug_launcher``;
* :mod:`~nbaccel.launch.handle` -- ``LaunchHandle`` (``block=False``), restarts;
* ``_preflight`` checks everything before anything starts; ``_attempt``, ``_spawn``,
  ``_rendezvous`` start one group of workers (fork, or spawn shipping the function with dill);
  ``_preload`` prepares the kernel before a fork (``torch._dynamo`` only when the launched
  code needs it);
  ``_supervise``, ``_output``, ``_failures``, ``_wire`` bring output, results and the
  first real error back; ``_status`` keeps each rank's live state for ``status()`` and
  the listeners (a launch's and a pool's); ``_bootstrap`` and ``_worker_os`` run in the
  worker before the user's function; ``_xla`` starts TPU workers through ``xmp.spawn``;
* :mod:`~nbaccel.launch.pool` -- ``start_workers``/``WorkerPool``: warm workers kept
  across cells (``_pool_start`` starts them, ``_pool_worker`` is their job loop,
  ``_pool_engine``/``_pool_call`` run and supervise one call); :mod:`~nbaccel.launch.magic`
  -- the ``%%distributed`` cell magic (``%load_ext nbaccel``);
* :mod:`~nbaccel.launch.testing` -- ``run_on_workers`` for tests.
"""
