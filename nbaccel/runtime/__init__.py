"""What runs inside the training function, on every rank: the ``Accelerator`` and its parts.

One folder per concept (each ``__init__`` names its job):

* :mod:`~nbaccel.runtime.facade` -- ``Accelerator`` (and its method groups), ``PartialState``
  / ``AcceleratorState``, the option objects, the self-check;
* :mod:`~nbaccel.runtime.strategy` -- how a model trains across processes, one sub-folder per
  strategy (``ddp``, ``fsdp``, ``deepspeed``, ``xla``; the single process and the interface
  in ``strategy/base.py``), reached only through that interface;
* :mod:`~nbaccel.runtime.process` -- the frozen process state and the process group, RNG,
  all-ranks checks;
* :mod:`~nbaccel.runtime.loading` -- prepared dataloaders, sharding, ``dispatch_batches``,
  uneven inputs;
* :mod:`~nbaccel.runtime.collectives` -- gather/reduce/broadcast on tensor trees, triggers,
  ``split_between_processes``;
* :mod:`~nbaccel.runtime.training` -- gradient accumulation, prepared optimizers and
  schedulers, local SGD;
* :mod:`~nbaccel.runtime.saving` -- what a checkpoint holds (the files are written by
  :mod:`nbaccel.checkpoint`, the layer below: directory protocol, weights, DCP);
* :mod:`~nbaccel.runtime.compute` -- mixed precision, fp8, ``torch.compile``;
* :mod:`~nbaccel.runtime.accelerate_utils` -- the names ported scripts import from
  Accelerate's ``utils``.

The runtime never imports :mod:`nbaccel.launch`, :mod:`nbaccel.ui` or :mod:`nbaccel.cli`:
it talks to a launcher only through :mod:`nbaccel.tracking.events`.
"""
