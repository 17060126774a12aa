"""``is_*_available`` and version helpers, with the names scripts import from ``accelerate.utils``.

Each answers for *this* nbaccel: a package check (``is_wandb_available``: can the wandb
tracker start?), a device nbaccel can train on (``is_cuda_available``), or ``False`` for
what nbaccel never drives, whatever is installed (Megatron-LM, MS-AMP,
TransformerEngine, NPU/XPU/MLU/MUSA/SDAA/HPU devices), so a script never takes a code
path that nbaccel would then refuse. Package checks never import the package.

Example:
    >>> is_megatron_lm_available(), is_torch_version(">=", "2.0")
    (False, True)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import operator
from collections.abc import Callable
from typing import Any

from ...errors import ConfigError

# helper name -> modules, any of which makes it True
_PACKAGES: dict[str, tuple[str, ...]] = {
    "is_aim_available": ("aim",),
    "is_bnb_available": ("bitsandbytes",),
    "is_4bit_bnb_available": ("bitsandbytes",),
    "is_8bit_bnb_available": ("bitsandbytes",),
    "is_boto3_available": ("boto3",),
    "is_clearml_available": ("clearml",),
    "is_comet_ml_available": ("comet_ml",),
    "is_datasets_available": ("datasets",),
    "is_deepspeed_available": ("deepspeed",),  # the DeepSpeed strategy (an optional extra)
    "is_dvclive_available": ("dvclive",),
    "is_lomo_available": ("lomo_optim",),
    "is_matplotlib_available": ("matplotlib",),
    "is_mlflow_available": ("mlflow",),
    "is_pandas_available": ("pandas",),
    "is_peft_available": ("peft",),
    "is_pynvml_available": ("pynvml",),
    "is_rich_available": ("rich",),
    "is_schedulefree_available": ("schedulefree",),
    "is_swanlab_available": ("swanlab",),
    "is_tensorboard_available": ("tensorboard", "tensorboardX"),
    "is_timm_available": ("timm",),
    "is_torchao_available": ("torchao",),
    "is_torchdata_available": ("torchdata",),
    "is_torchvision_available": ("torchvision",),
    "is_trackio_available": ("trackio",),
    "is_transformers_available": ("transformers",),
    "is_wandb_available": ("wandb",),
}
# what nbaccel never runs, so a script's "if available" branch must not be taken
_NEVER = (
    "is_megatron_lm_available",
    "is_msamp_available",
    "is_transformer_engine_available",
    "is_pippy_available",
    "is_ipex_available",
    "is_npu_available",
    "is_xpu_available",
    "is_mlu_available",
    "is_musa_available",
    "is_sdaa_available",
    "is_hpu_available",
)
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def _installed(*modules: str) -> bool:
    for name in modules:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _package_check(name: str, modules: tuple[str, ...]) -> Callable[..., bool]:
    def check(*args: Any, **kwargs: Any) -> bool:
        return _installed(*modules)

    check.__name__ = check.__qualname__ = name
    check.__doc__ = f"True if {' or '.join(modules)} can be imported here."
    return check


def _never(name: str) -> Callable[..., bool]:
    def check(*args: Any, **kwargs: Any) -> bool:
        return False

    check.__name__ = check.__qualname__ = name
    check.__doc__ = "Always False: nbaccel does not drive this (see the README's Porting)."
    return check


HELPERS: dict[str, Callable[..., bool]] = {
    **{name: _package_check(name, mods) for name, mods in _PACKAGES.items()},
    **{name: _never(name) for name in _NEVER},
}
globals().update(
    HELPERS
)  # module attributes: from nbaccel.runtime.accelerate_utils.availability import ...


def is_cuda_available() -> bool:
    """True if a CUDA GPU is visible (nbaccel trains on it)."""
    import torch

    return torch.cuda.is_available()


def is_mps_available(min_version: str | None = None) -> bool:
    """torch's answer for Apple's MPS (nbaccel itself trains on the CPU there)."""
    import torch

    return bool(torch.backends.mps.is_available())


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """True if torch_xla is installed (nbaccel runs on XLA devices through it)."""
    return _installed("torch_xla")


def is_tpu_available(check_device: bool = True) -> bool:
    """True if torch_xla is installed and ``PJRT_DEVICE`` asks for TPUs."""
    from ...platform.tpu import xla_requested

    return _installed("torch_xla") and xla_requested()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """True if bf16 mixed precision runs here (CPU, or a GPU that supports it)."""
    import torch

    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    return True


def is_fp8_available() -> bool:
    """True if fp8 training can run here (torchao and a GPU of compute capability >= 8.9)."""
    import torch

    if not (_installed("torchao") and torch.cuda.is_available()):
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


def _parse(version: str) -> Any:
    from packaging.version import Version

    return Version(str(version))


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """Compare a library's installed version (or a version string) with ``requirement_version``."""
    if operation not in _OPS:
        raise ConfigError(f"operation={operation!r}: use one of {list(_OPS)}.")
    version = library_or_version
    if isinstance(version, str) and not version[:1].isdigit():
        version = importlib.metadata.version(version)
    return _OPS[operation](_parse(str(version)), _parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch's version, e.g. ``is_torch_version(">=", "2.4")``."""
    import torch

    return compare_versions(torch.__version__.split("+")[0], operation, version)


def is_peft_model(model: Any) -> bool:
    """True if ``model`` (or the module inside DDP / ``torch.compile``) is a peft ``PeftModel``."""
    if not _installed("peft"):
        return False
    from peft import PeftModel

    from ..training.wrappers import unwrap_model

    return isinstance(unwrap_model(model), PeftModel)


def is_compiled_module(module: Any) -> bool:
    """True for the module ``torch.compile`` returns."""
    from ..compute.dynamo import is_compiled

    return is_compiled(module)


__all__ = [
    *HELPERS,
    "HELPERS",
    "compare_versions",
    "is_bf16_available",
    "is_compiled_module",
    "is_cuda_available",
    "is_fp8_available",
    "is_mps_available",
    "is_peft_model",
    "is_torch_version",
    "is_torch_xla_available",
    "is_tpu_available",
]
