"""What runs inside the training function, on every rank: the ``Accelerator`` and its parts.

* :mod:`~nbaccel.runtime.accelerator` -- the facade; it delegates to the modules below;
* :mod:`~nbaccel.runtime.state` -- the frozen process state and the process group;
* :mod:`~nbaccel.runtime.strategy` -- single process, DDP, XLA: wrap, sync, clip, state dicts;
* :mod:`~nbaccel.runtime.precision`, :mod:`~nbaccel.runtime.accumulation`,
  :mod:`~nbaccel.runtime.wrappers` -- mixed precision, micro-steps, prepared optimizers;
* :mod:`~nbaccel.runtime.data`, :mod:`~nbaccel.runtime.sharding` -- prepared dataloaders;
* :mod:`~nbaccel.runtime.ops`, :mod:`~nbaccel.runtime.tree`, :mod:`~nbaccel.runtime.rng` --
  collectives, tensor trees, RNG synchronisation;
* :mod:`~nbaccel.runtime.checkpointing`, :mod:`~nbaccel.runtime.model_io` -- what a
  checkpoint holds, written through :mod:`nbaccel.checkpoint`; :mod:`~nbaccel.runtime.hooks`
  -- save/load pre-hooks;
* :mod:`~nbaccel.runtime.partial_state` -- ``PartialState`` / ``AcceleratorState``;
  :mod:`~nbaccel.runtime.dispatch` -- ``dispatch_batches``; :mod:`~nbaccel.runtime.join`,
  :mod:`~nbaccel.runtime.triggers`, :mod:`~nbaccel.runtime.dynamo`,
  :mod:`~nbaccel.runtime.compat` -- the rest of the peer's documented API (the facade's
  thin methods are grouped in ``_process_api`` and ``_collective_api``).

The runtime never imports :mod:`nbaccel.launch`, :mod:`nbaccel.ui` or :mod:`nbaccel.cli`:
it talks to a launcher only through :mod:`nbaccel.tracking.events`.
"""
