"""Files on disk: the atomic checkpoint-directory protocol and weights I/O.

* :mod:`~nbaccel.checkpoint.directory` -- temporary name, fsync, manifest, rename, pruning;
* :mod:`~nbaccel.checkpoint.weights` -- safetensors/torch files, shards plus index, tied weights.

What goes into a checkpoint is decided by :mod:`nbaccel.runtime.saving.checkpointing`.
"""
