"""The engine: one supervisor over a group of started workers, and their cleanup.

``_supervisor`` (acts on the channel's messages, waits for a job, raises the first real
failure; extras plug in as hooks), ``_group`` (the kernel's side of started workers: read
them, end them, the kernel's ends of their pipes and channels), ``_tidy`` (a failure as the
notebook shows it) and ``_lifetimes`` (one exit hook ends every live worker). How workers
are started is ``start/``'s business; a start backend hands the engine
:class:`~._group.WorkerProcess` views through ``_group``'s public names.
"""
