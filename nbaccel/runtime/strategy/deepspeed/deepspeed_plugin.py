"""``DeepSpeedPlugin``, ``DummyOptim``, ``DummyScheduler``: DeepSpeed's settings, as Accelerate names them.

The ``deepspeed`` package is an optional extra (``pip install --no-build-isolation deepspeed``);
nothing here imports it. A plugin holds one DeepSpeed configuration dict
(:attr:`DeepSpeedPlugin.deepspeed_config`): read from ``hf_ds_config`` (a JSON file, a
dict) or built from the fields. Values written ``"auto"`` are filled in ``prepare`` from
the prepared objects (:mod:`nbaccel.runtime.strategy.deepspeed._deepspeed_config`). Without an explicit
plugin, ``Accelerator()`` builds one from the launch configuration
(``LaunchConfig(strategy="deepspeed", deepspeed_zero_stage=...)``, the YAML file), see
:func:`deepspeed_from_launch_config`.

Example:
    >>> plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu")
    >>> plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]
    {'device': 'cpu'}
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ....config import launch_config
from ....config.choices import DEEPSPEED_OFFLOAD_DEVICES, DEEPSPEED_ZERO_STAGES
from ....errors import ConfigError

#: the one command that makes DeepSpeed available (named by every "not installed" error)
INSTALL = "pip install --no-build-isolation deepspeed  (after torch; its build imports torch)"


def deepspeed_installed() -> bool:
    """True if the ``deepspeed`` package can be imported (nothing is imported to find out)."""
    return importlib.util.find_spec("deepspeed") is not None


def require_deepspeed(what: str = "DeepSpeed") -> None:
    """Raise a ``ConfigError`` naming the install command unless ``deepspeed`` is installed."""
    if not deepspeed_installed():
        raise ConfigError(
            f"{what} needs the deepspeed package, which is not installed in this environment "
            f"(the kernel and the workers use the same one). Install it with: {INSTALL}; then "
            "restart the kernel. Or train without it: strategy='fsdp' (FSDP2) or 'ddp'."
        )


@dataclass
class DeepSpeedPlugin:
    """Settings of the DeepSpeed strategy; pass it as ``Accelerator(deepspeed_plugin=...)``.

    Args:
        hf_ds_config: a DeepSpeed configuration: a path to a JSON file, or a dict. Keys
            set to ``"auto"`` are filled from the prepared objects and the Accelerator
            (batch sizes, accumulation, precision, optimizer/scheduler parameters of
            ``DummyOptim``/``DummyScheduler``, bucket sizes from ``model.config.hidden_size``).
            When given, the fields below only fill its ``"auto"`` values.
        gradient_accumulation_steps: micro-steps per update; ``None``: the Accelerator's.
        gradient_clipping: clip the global gradient norm to this value (inside
            ``accelerator.backward``); ``None``: DeepSpeed's default (1.0 in deepspeed
            0.19, as under Accelerate); 0: no clipping.
        zero_stage: 0 (plain data parallel), 1 (optimizer state sharded), 2 (+ gradients),
            3 (+ parameters).
        is_train_batch_min: with several dataloaders, the smallest batch size is the
            micro-batch size (else the largest).
        offload_optimizer_device: ``"none"``, ``"cpu"`` or ``"nvme"`` (ZeRO-Offload: fp32
            master weights and optimizer state in CPU memory; ZeRO 1-3).
        offload_param_device: ``"none"``, ``"cpu"`` or ``"nvme"`` (ZeRO-3 only).
        offload_optimizer_nvme_path: directory for ``offload_optimizer_device="nvme"``.
        offload_param_nvme_path: directory for ``offload_param_device="nvme"``.
        zero3_init_flag: accepted for compatibility (``deepspeed.zero.Init`` is for
            ``from_pretrained``; nbaccel partitions the model in ``prepare``).
        zero3_save_16bit_model: ZeRO-3's ``stage3_gather_16bit_weights_on_model_save``
            (nbaccel gathers the full weights for ``save_model``/``get_state_dict`` anyway).
        transformer_moe_cls_names: accepted for compatibility (MoE leaf modules are not set).
        enable_msamp: MS-AMP fp8: only ``False`` (nbaccel does not drive MS-AMP).
        msamp_opt_level: accepted for compatibility (MS-AMP's level).

    Raises:
        ConfigError: an unknown stage or offload device, an unreadable config file, or
            offloading parameters below ZeRO-3.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool = False
    msamp_opt_level: str = "O1"
    deepspeed_config: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.enable_msamp:
            raise ConfigError(
                "DeepSpeedPlugin(enable_msamp=True): nbaccel does not drive MS-AMP; train in "
                "bf16 (mixed_precision='bf16') and drop enable_msamp."
            )
        if self.zero_stage is not None and self.zero_stage not in DEEPSPEED_ZERO_STAGES:
            raise ConfigError(
                f"DeepSpeedPlugin(zero_stage={self.zero_stage!r}) is unknown; use 0, 1, 2 or 3."
            )
        for name in ("offload_optimizer_device", "offload_param_device"):
            value = getattr(self, name)
            if value is not None and str(value).lower() not in DEEPSPEED_OFFLOAD_DEVICES:
                raise ConfigError(
                    f"DeepSpeedPlugin({name}={value!r}) is unknown; use "
                    f"{', '.join(repr(d) for d in DEEPSPEED_OFFLOAD_DEVICES)}."
                )
        if self.hf_ds_config is not None:
            self.deepspeed_config = _read_config(self.hf_ds_config)
            self._fill_from_fields()
        else:
            self.deepspeed_config = self._built_config()
        zero = self.deepspeed_config.setdefault("zero_optimization", {})
        param = str(zero.get("offload_param", {}).get("device", "none")).lower()
        if param != "none" and zero.get("stage") not in (3, "auto"):
            raise ConfigError(
                f"offload_param_device={param!r} needs ZeRO-3 (parameters are partitioned only "
                "at stage 3): set zero_stage=3, or offload the optimizer instead "
                "(offload_optimizer_device='cpu')."
            )

    def _built_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": 2 if self.zero_stage is None else self.zero_stage}
        for kind, device, path in (
            ("optimizer", self.offload_optimizer_device, self.offload_optimizer_nvme_path),
            ("param", self.offload_param_device, self.offload_param_nvme_path),
        ):
            entry: dict[str, Any] = {"device": str(device or "none").lower()}
            if entry["device"] == "nvme":
                entry["nvme_path"] = path or "auto"
            zero[f"offload_{kind}"] = entry
        if zero["stage"] == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = bool(self.zero3_save_16bit_model)
        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps or "auto",
            "zero_optimization": zero,
            "steps_per_print": 2**62,  # DeepSpeed's own progress lines: the monitor shows steps
        }
        if self.gradient_clipping is not None:
            config["gradient_clipping"] = float(self.gradient_clipping)
        return config

    def _fill_from_fields(self) -> None:
        """Fields given together with ``hf_ds_config`` fill its ``"auto"`` values."""
        config = self.deepspeed_config
        zero = config.get("zero_optimization", {})
        if self.zero_stage is not None and zero.get("stage") == "auto":
            zero["stage"] = self.zero_stage
        if self.gradient_clipping is not None and config.get("gradient_clipping") == "auto":
            config["gradient_clipping"] = float(self.gradient_clipping)
        steps = self.gradient_accumulation_steps
        if steps is not None and config.get("gradient_accumulation_steps") == "auto":
            config["gradient_accumulation_steps"] = steps
        for kind, device in (
            ("optimizer", self.offload_optimizer_device),
            ("param", self.offload_param_device),
        ):
            entry = zero.get(f"offload_{kind}")
            if device is not None and isinstance(entry, dict) and entry.get("device") == "auto":
                entry["device"] = str(device).lower()

    @property
    def zero_stage_value(self) -> int:
        """The ZeRO stage of the configuration (0 if it names none)."""
        stage = self.deepspeed_config.get("zero_optimization", {}).get("stage", 0)
        return int(stage) if stage != "auto" else 2

    def is_auto(self, key: str) -> bool:
        """True if the dotted ``key`` (e.g. ``"zero_optimization.stage"``) is ``"auto"``."""
        return self.get_value(key) == "auto"

    def get_value(self, key: str, default: Any = None) -> Any:
        """The value at the dotted ``key`` of :attr:`deepspeed_config` (``default`` if absent)."""
        node: Any = self.deepspeed_config
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    @classmethod
    def from_config(cls, cfg: Any) -> DeepSpeedPlugin:
        """The plugin a :class:`~nbaccel.LaunchConfig` with ``strategy="deepspeed"`` describes.

        Example:
            >>> from nbaccel import LaunchConfig
            >>> DeepSpeedPlugin.from_config(LaunchConfig(strategy="deepspeed")).zero_stage
            2
        """
        return cls(  # with a config file the fields fill only its "auto" values
            hf_ds_config=cfg.deepspeed_config_file or None,
            zero_stage=cfg.deepspeed_zero_stage,
            offload_optimizer_device=cfg.deepspeed_offload_optimizer_device,
            offload_param_device=cfg.deepspeed_offload_param_device,
            gradient_clipping=cfg.deepspeed_gradient_clipping,
        )


def _read_config(source: Any) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    config = getattr(source, "config", None)  # transformers' HfDeepSpeedConfig
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(source, str | os.PathLike):
        raise ConfigError(
            f"hf_ds_config={source!r} must be a path to a DeepSpeed JSON file or a dict."
        )
    path = Path(source).expanduser()
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"hf_ds_config={str(source)!r}: no such file (relative paths start at "
            f"{os.getcwd()!r}, the working directory of every process)."
        ) from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"hf_ds_config={str(source)!r} is not readable JSON: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"hf_ds_config={str(source)!r} holds {type(loaded).__name__}, not {{}}.")
    return loaded


class DummyOptim:
    """Stands for the optimizer that the DeepSpeed config's ``"optimizer"`` section defines.

    Example:
        >>> import torch
        >>> DummyOptim(torch.nn.Linear(2, 2).parameters(), lr=3e-4).lr
        0.0003
    """

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any):
        self.params = list(params)
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for the scheduler the DeepSpeed config's ``"scheduler"`` section defines (or
    ``lr_scheduler_callable(optimizer)``, called with DeepSpeed's optimizer).

    Example:
        >>> import torch
        >>> optimizer = DummyOptim(torch.nn.Linear(2, 2).parameters())
        >>> DummyScheduler(optimizer, total_num_steps=100, warmup_num_steps=10).warmup_num_steps
        10
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Any = None,
        **kwargs: Any,
    ):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def check_deepspeed_argument(plugin: Any, fsdp_plugin: Any = None) -> DeepSpeedPlugin | None:
    """Validate ``Accelerator(deepspeed_plugin=...)``; return it (``None`` stays ``None``)."""
    if plugin is None:
        return None
    if fsdp_plugin is not None:
        raise ConfigError(
            "fsdp_plugin and deepspeed_plugin were both given: choose one (FSDP2 and "
            "DeepSpeed's ZeRO both shard the model; one strategy trains it)."
        )
    if isinstance(plugin, Mapping):
        raise ConfigError(
            "deepspeed_plugin got a dict of several plugins; nbaccel drives one DeepSpeed "
            "engine per Accelerator: pass one DeepSpeedPlugin(...)."
        )
    if not isinstance(plugin, DeepSpeedPlugin):
        raise ConfigError(
            f"deepspeed_plugin={plugin!r} must be a nbaccel.DeepSpeedPlugin "
            "(from nbaccel import DeepSpeedPlugin)."
        )
    require_deepspeed("Accelerator(deepspeed_plugin=...)")  # before any process state exists
    return plugin


def deepspeed_from_launch_config() -> DeepSpeedPlugin | None:
    """The plugin the launch configuration asks for (``strategy="deepspeed"``), else ``None``."""
    cfg = launch_config()
    return DeepSpeedPlugin.from_config(cfg) if cfg.strategy == "deepspeed" else None


__all__ = [
    "INSTALL",
    "DeepSpeedPlugin",
    "DummyOptim",
    "DummyScheduler",
    "check_deepspeed_argument",
    "deepspeed_from_launch_config",
    "deepspeed_installed",
    "require_deepspeed",
]
