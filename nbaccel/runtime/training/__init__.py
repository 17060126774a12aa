"""The training step: gradient accumulation, prepared optimizers/schedulers, uneven inputs, local SGD."""
