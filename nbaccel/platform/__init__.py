"""Pure detection, the bottom layer: what machine, kernel and devices this is.

Nothing here initialises CUDA or XLA or imports anything of nbaccel above ``errors``.

* :mod:`~nbaccel.platform.environment` -- notebook kernel, Colab/Kaggle, CPU/GPU counts, loopback;
* :mod:`~nbaccel.platform.hardware` -- the :class:`~nbaccel.platform.hardware.Hardware` summary;
* :mod:`~nbaccel.platform.process_env` -- ``RANK``/``WORLD_SIZE``/... parsed once;
* :mod:`~nbaccel.platform.tpu` -- the TPU backend: its protocol, torch_xla, which one is wanted;
* :mod:`~nbaccel.platform.cudatrace` -- where CUDA was first initialised in this process;
* :mod:`~nbaccel.platform.forksafe` -- releasing the OpenMP pool before a fork.
* :mod:`~nbaccel.platform.torchcompat` -- what the installed torch can do (2.4 .. newest).
"""
