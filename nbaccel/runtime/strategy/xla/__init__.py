"""torch_xla devices: DDP over the ``"xla"`` process-group backend."""
