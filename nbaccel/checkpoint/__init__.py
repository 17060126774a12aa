"""Checkpoint files on disk and on object storage: the atomic directory protocol, weights I/O.

* :mod:`~nbaccel.checkpoint.directory` -- temporary name, fsync, manifest, rename, pruning;
* :mod:`~nbaccel.checkpoint.weights` -- safetensors/torch files, shards plus index, tied weights;
* :mod:`~nbaccel.checkpoint.store` -- fsspec URLs: open a store or refuse naming the package;
* :mod:`~nbaccel.checkpoint.remote` -- the same protocol on object storage (manifest last).

What goes into a checkpoint is decided by :mod:`nbaccel.runtime.saving.checkpointing`.
"""
