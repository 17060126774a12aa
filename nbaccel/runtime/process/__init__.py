"""Who this process is: the frozen process state, ``PartialState``, RNG sync and all-ranks checks."""
