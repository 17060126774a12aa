"""Data loading: prepared dataloaders, sharding across ranks, dispatching batches, resumable state."""
