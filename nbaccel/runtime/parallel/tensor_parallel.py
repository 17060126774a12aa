"""Tensor parallel on the ``tp`` sub-mesh: apply a user's plan, or check a model that
transformers already parallelised.

A plain module is parallelised with torch's ``parallelize_module`` and parallel styles
(``ColwiseParallel``, ``RowwiseParallel``, ...) given as
``TorchTensorParallelConfig(plan={...})``. A model whose parameters are DTensors already
(``from_pretrained(tp_plan="auto", device_mesh=...)``, or the user's own
``parallelize_module`` call) is checked: its tensor-parallel mesh must be this mesh's
``tp`` dimension, else FSDP would shard across the wrong ranks and training would give
wrong numbers -- transformers versions that build their own mesh from the world size are
refused here, before the first step, saying so; and :func:`check_transformers_mesh`
refuses, before any model is loaded, the one layout such a transformers cannot load.

Example:
    >>> import torch
    >>> is_tensor_parallel(torch.nn.Linear(2, 2))
    False
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ConfigError


def _dtensor_type() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` is a DTensor (parallelised already)."""
    dtensor = _dtensor_type()
    return any(isinstance(p, dtensor) for p in model.parameters())


def _mesh_ranks(mesh: Any) -> list[int]:
    return sorted(int(r) for r in mesh.mesh.flatten().tolist())


def check_tp_mesh(model: torch.nn.Module, tp_mesh: Any) -> None:
    """Raise unless every DTensor parameter lives on ``tp_mesh`` (the same ranks).

    Raises:
        ConfigError: a parameter on another mesh (transformers' own, typically).
    """
    dtensor = _dtensor_type()
    want = _mesh_ranks(tp_mesh)
    for name, param in model.named_parameters():
        if not isinstance(param, dtensor):
            continue
        got = _mesh_ranks(param.device_mesh)
        if got != want:
            raise ConfigError(
                f"tensor parallel: parameter {name!r} is sharded over ranks {got}, but this "
                f"process's 'tp' mesh is ranks {want}. The model was parallelised on another "
                "mesh (transformers versions that ignore device_mesh= build their own from the "
                "world size). Build it with from_pretrained(..., tp_plan='auto', "
                "device_mesh=accelerator.torch_device_mesh['tp']) where transformers honours "
                "it, or load it plainly and pass a plan: ParallelismConfig(tp_handler="
                "TorchTensorParallelConfig(plan={...})), which nbaccel applies on the 'tp' mesh."
            )


def transformers_builds_its_own_mesh() -> bool:
    """Whether the transformers imported here builds its tensor-parallel mesh from the world
    size and ignores ``from_pretrained(device_mesh=...)`` (5.x's ``DistributedConfig``)."""
    import sys

    if "transformers" not in sys.modules:  # never import it for this
        return False
    try:
        from transformers.distributed import utils
    except ImportError:
        return False
    return hasattr(utils, "initialize_distributed_mesh")


def check_transformers_mesh(config: Any) -> None:
    """Refuse, before any model is loaded, tensor parallel x data parallel with no plan of
    nbaccel's when the transformers imported here builds its own mesh.

    Without a plan, the model is expected to come parallelised, and Accelerate's way is
    ``from_pretrained(tp_plan="auto", tp_size=..., device_mesh=...)``; transformers 5.x
    ignores ``device_mesh=``, builds a mesh of ``tp_size`` processes and stops inside
    loading ("The parallel mesh requires 2 processes, but world_size is 4"). Refused here,
    in ``Accelerator(...)``, so the user reads nbaccel's error and its fix first.

    Raises:
        ConfigError: naming the transformers version and ``plan=``.
    """
    import sys

    handler = getattr(config, "tp_handler", None)
    if (
        not config.tp_enabled
        or config.data_parallel_size == 1  # tp alone: transformers' mesh is nbaccel's
        or getattr(handler, "plan", None)
        or not transformers_builds_its_own_mesh()
    ):
        return
    version = getattr(sys.modules["transformers"], "__version__", "?")
    raise ConfigError(
        f"{config!r} without a tensor-parallel plan: the model would have to come parallelised "
        f"from from_pretrained(..., tp_plan='auto', device_mesh=...), but transformers "
        f"{version} ignores device_mesh= and builds its own mesh of tp_size processes, which "
        f"cannot hold {config.total_size} (it stops while loading: 'The parallel mesh "
        "requires N processes, but world_size is M'). Load the model without tp_plan/tp_size "
        "and let nbaccel split it on its 'tp' mesh: ParallelismConfig(..., tp_handler="
        "TorchTensorParallelConfig(plan='auto')) applies the model's own plan (or plan={...} "
        "with torch's ColwiseParallel/RowwiseParallel). A model you parallelise yourself on "
        "accelerator.torch_device_mesh['tp'] before prepare is checked, not split again: "
        "give the plan you applied."
    )


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
    }


def transformers_plan(model: torch.nn.Module) -> dict[str, Any]:
    """A transformers model's own tensor-parallel plan (``model._tp_plan``: module name
    patterns -> style names) as torch parallel styles, to apply on nbaccel's ``tp`` mesh.

    Raises:
        ConfigError: the model has no plan, or a style torch's basic styles cannot express.
    """
    names = getattr(model, "_tp_plan", None) or {}
    if not names:
        raise ConfigError(
            f"TorchTensorParallelConfig(plan='auto'): {type(model).__name__} has no tensor-"
            "parallel plan of its own (transformers models carry one as _tp_plan); pass "
            "plan={'submodule': ColwiseParallel(), ...} with torch's parallel styles."
        )
    styles = _styles()
    unknown = sorted({style for style in names.values() if style not in styles})
    if unknown:
        raise ConfigError(
            f"TorchTensorParallelConfig(plan='auto'): {type(model).__name__}'s plan uses "
            f"{unknown}, which nbaccel maps to no torch style (it maps {sorted(styles)}); "
            "pass your own plan={...} with torch's parallel styles."
        )
    return {pattern: styles[style] for pattern, style in names.items()}


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, plan: Any) -> torch.nn.Module:
    """Parallelise ``model`` on ``tp_mesh``: check it if it is a DTensor model already,
    else apply ``plan`` with ``parallelize_module``.

    Raises:
        ConfigError: no plan for a plain module, or a model on another mesh.
    """
    if is_tensor_parallel(model):
        check_tp_mesh(model, tp_mesh)
        return model
    if not plan:
        raise ConfigError(
            f"tp_size={tp_mesh.size()} but this {type(model).__name__} is not tensor-parallel "
            "and no plan was given: pass ParallelismConfig(tp_handler=TorchTensorParallelConfig("
            "plan={'layer': ColwiseParallel(), ...})) with torch's parallel styles, or build a "
            "transformers model with from_pretrained(..., tp_plan='auto', device_mesh=...)."
        )
    from torch.distributed.tensor.parallel import parallelize_module

    if plan == "auto":
        plan = transformers_plan(model)
    if not isinstance(plan, dict):
        plan = dict(plan)
    names = {n for n, _ in model.named_modules()}
    missing = sorted(k for k in plan if "*" not in k and k not in names)  # typos, early
    if missing:
        raise ConfigError(
            f"TorchTensorParallelConfig(plan=...) names {missing}, which this model does not "
            f"contain; its submodules are {sorted(n for n in names if n)[:20]}."
        )
    parallelize_module(model, tp_mesh, plan)
    return model


__all__ = [
    "apply_tensor_parallel",
    "check_tp_mesh",
    "check_transformers_mesh",
    "is_tensor_parallel",
    "transformers_builds_its_own_mesh",
    "transformers_plan",
]
