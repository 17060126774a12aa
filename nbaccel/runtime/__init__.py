"""What runs inside the training function, on every rank: the ``Accelerator`` and its parts.

* :mod:`~nbaccel.runtime.facade.accelerator` -- the facade; it delegates to the modules below;
* :mod:`~nbaccel.runtime.process.state` -- the frozen process state and the process group;
* :mod:`~nbaccel.runtime.strategy` -- single process, DDP, XLA: wrap, sync, clip, state dicts;
* :mod:`~nbaccel.runtime.compute.precision`, :mod:`~nbaccel.runtime.training.accumulation`,
  :mod:`~nbaccel.runtime.training.wrappers` -- mixed precision, micro-steps, prepared optimizers;
* :mod:`~nbaccel.runtime.loading.data`, :mod:`~nbaccel.runtime.loading.sharding` -- prepared dataloaders;
* :mod:`~nbaccel.runtime.collectives.ops`, :mod:`~nbaccel.runtime.collectives.tree`, :mod:`~nbaccel.runtime.process.rng` --
  collectives, tensor trees, RNG synchronisation;
* :mod:`~nbaccel.runtime.saving.checkpointing`, :mod:`~nbaccel.runtime.saving.model_io` -- what a
  checkpoint holds, written through :mod:`nbaccel.checkpoint`; :mod:`~nbaccel.runtime.saving.hooks`
  -- save/load pre-hooks;
* :mod:`~nbaccel.runtime.facade.partial_state` -- ``PartialState`` / ``AcceleratorState``;
  :mod:`~nbaccel.runtime.loading.dispatch` -- ``dispatch_batches``; :mod:`~nbaccel.runtime.loading.join`,
  :mod:`~nbaccel.runtime.collectives.triggers`, :mod:`~nbaccel.runtime.compute.dynamo`,
  :mod:`~nbaccel.runtime.accelerate_utils.compat` -- the rest of the peer's documented API (the facade's
  thin methods are grouped in ``_process_api`` and ``_collective_api``).

The runtime never imports :mod:`nbaccel.launch`, :mod:`nbaccel.ui` or :mod:`nbaccel.cli`:
it talks to a launcher only through :mod:`nbaccel.tracking.events`.
"""
