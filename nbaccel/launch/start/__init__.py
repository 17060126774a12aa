"""Starting workers: check and plan a launch, then start its group by one start backend.

``_preflight`` (everything checked and decided before a process exists), ``_freegpus``
(notebook GPUs' quirks handled before the start), ``_start`` (a plan's rendezvous, specs
and processes, handed to the engine's supervisor), ``_forkserver`` (workers forked from a
copy of the kernel taken before CUDA), ``_tpu`` (how many workers a TPU launch starts), and one sub-folder per remote backend: ``cluster/``
(Ray). A backend uses the engine's public names only, never its private ones.
"""
