"""Which ``Linear`` layers run in fp8, and converting them with torchao's float8 training.

``mixed_precision="fp8"`` (:class:`~nbaccel.runtime.compute.precision.Fp8Precision`) converts a
model's layers here before wrapping. The default choice follows Accelerate's rule for
torchao (the first and last ``Linear`` stay in high precision, for stability) and converts,
of the others, only the layers that gain from fp8 on an H100/H200; an ``AORecipeKwargs``
passes torchao's ``Float8LinearConfig`` and a layer filter of the user's own.

Example:
    >>> import torch
    >>> with torch.device("meta"):  # shapes only
    ...     mlp = torch.nn.Sequential(*(torch.nn.Linear(8192, 8192) for _ in range(3)))
    >>> fp8_layers(mlp)
    ['1']
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch


def unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 cannot run on ``device`` (no CUDA, compute capability < 8.9, no torchao), or None."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU and this process runs on {device.type!r}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (
            f"it needs compute capability >= 8.9 (Ada/Hopper or newer) and {name} has "
            f"{major}.{minor}"
        )
    try:
        importlib.import_module("torchao.float8")
    except ImportError as err:
        return f"the torchao package is missing or too old ({err}); pip install torchao"
    return None


def fp8_gains(module: torch.nn.Module) -> bool:
    """Whether torchao's float8 (tensorwise recipe) speeds this layer up on an H100/H200.

    torchao's rule (``_auto_filter_for_recipe("tensorwise")``, from its H100 tables): a
    ``Linear`` whose dimensions are multiples of 16 (the fp8 kernels need it), and not
    both ``in_features <= 4096`` and ``out_features <= 1024`` (smaller layers lose more to
    casting and scaling than the fp8 matrix product saves).

    Example:
        >>> fp8_gains(torch.nn.Linear(4096, 16384)), fp8_gains(torch.nn.Linear(256, 1024))
        (True, False)
    """
    if not isinstance(module, torch.nn.Linear):
        return False
    n, k = module.out_features, module.in_features
    return n % 16 == 0 and k % 16 == 0 and not (k <= 4096 and n <= 1024)


EAGER = (
    "torchao's float8 runs slower than bf16 without torch.compile (0.53x on a 4096->16384->4096 "
    "MLP with 16384 tokens on an H200; 1.36x faster compiled): the casts and scales are "
    "separate kernels until the compiler fuses them"
)


def fp8_layers(model: torch.nn.Module) -> list[str]:
    """The ``Linear`` layers ``mixed_precision="fp8"`` converts by default, by name.

    Accelerate's rule (its torchao path): the first and the last ``Linear`` of the model
    stay in high precision, for stability; of the others, nbaccel converts only those that
    gain from fp8 (:func:`fp8_gains`), where Accelerate converts every one whose
    dimensions are multiples of 16 (``AORecipeKwargs(module_filter_func=...)`` chooses).

    Example:
        >>> with torch.device("meta"):  # shapes only
        ...     mlp = torch.nn.Sequential(*(torch.nn.Linear(8192, 8192) for _ in range(3)))
        >>> fp8_layers(mlp)
        ['1']
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kept = {linears[0][0], linears[-1][0]} if linears else set()
    return [n for n, m in linears if n not in kept and fp8_gains(m)]


def convert(model: torch.nn.Module, recipe: Any = None) -> torch.nn.Module:
    """Convert ``model``'s chosen layers to ``Float8Linear`` (``recipe``: an ``AORecipeKwargs``);
    warn once where none is chosen by default."""
    from torchao.float8 import convert_to_float8_training  # Fp8Precision checked it is there

    config = getattr(recipe, "config", None)
    chosen = getattr(recipe, "module_filter_func", None)
    if chosen is None:
        names = set(fp8_layers(model))
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        if linears and not names:
            sizes = sorted({(m.in_features, m.out_features) for m in linears})[:4]
            shown = ", ".join(f"{k}->{n}" for k, n in sizes)
            warnings.warn(
                f"mixed_precision='fp8': none of this model's {len(linears)} Linear layers "
                f"({shown}{', ...' if len(linears) > 4 else ''}) is converted: the first "
                "and last stay in bf16 (as in Accelerate) and the others are too small to "
                "gain (torchao's tables: dimensions multiples of 16, and in_features > 4096 "
                "or out_features > 1024), so training runs as mixed_precision='bf16' would. "
                "fp8 pays on layers of 4096x16384 and more with 16k tokens or more per "
                "step; AORecipeKwargs(module_filter_func=...) chooses the layers.",
                RuntimeWarning,
                stacklevel=5,
            )
        chosen = lambda _module, name: name in names  # noqa: E731
    return convert_to_float8_training(model, module_filter_fn=chosen, config=config)


__all__ = ["EAGER", "convert", "fp8_gains", "fp8_layers", "unavailable_reason"]
