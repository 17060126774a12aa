"""The mesh strategy: a ``ParallelismConfig``'s tensor parallel and FSDP2 (HSDP) on a DeviceMesh."""
