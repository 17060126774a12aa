"""FSDP2: the strategy, its plugin and what it shards as a unit."""
