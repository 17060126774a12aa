"""DistributedDataParallel: the strategy and its gradient communication hooks."""
