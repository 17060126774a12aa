"""What a checkpoint holds (models, optimizers, RNG, shards) and its hooks; the files are written by :mod:`nbaccel.checkpoint`."""
