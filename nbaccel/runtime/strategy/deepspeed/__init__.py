"""DeepSpeed: the strategy, its plugin, filling its configuration and preparing its engine."""
