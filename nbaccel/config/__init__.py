"""Launch configuration: one dataclass, one YAML file, one precedence rule.

* :mod:`~nbaccel.config.choices` -- precision modes, start methods, compute devices;
* :mod:`~nbaccel.config.launch_config` -- :class:`LaunchConfig` and its field facts;
* :mod:`~nbaccel.config.options` -- the launch functions' other options, their defaults
  and help (:class:`StartOptions`, :class:`CallOptions`);
* :mod:`~nbaccel.config.file` / :mod:`~nbaccel.config.store` -- the YAML file;
* :mod:`~nbaccel.config.precedence` -- arguments > ``NBACCEL_*`` > file > defaults, and
  the configuration a launcher installed in a worker.

Example:
    >>> from nbaccel.config import LaunchConfig, resolve_launch_config
    >>> resolve_launch_config({"num_processes": 2}, environ={}, config_file=False).num_processes
    2
"""

from .choices import (
    COMPUTE_DEVICES,
    PRECISIONS,
    START_METHODS,
    STRATEGIES,
    ComputeDeviceType,
    PrecisionType,
    StartMethodType,
    normalize_precision,
)
from .fields import field_help, field_kind, field_names, field_optional
from .file import CONFIG_VERSION, RENAMED_KEYS, default_config_path
from .launch_config import INT_MINIMUMS, MAX_PORT, LaunchConfig
from .options import CallOptions, StartOptions
from .precedence import (
    ENV_VARS,
    install_launch_config,
    installed_launch_config,
    launch_config,
    resolve_launch_config,
)
from .store import load_config, save_config, write_basic_config
from .strategy import strategy_environment, strategy_fields

__all__ = [
    "COMPUTE_DEVICES",
    "CONFIG_VERSION",
    "ENV_VARS",
    "INT_MINIMUMS",
    "MAX_PORT",
    "PRECISIONS",
    "RENAMED_KEYS",
    "START_METHODS",
    "STRATEGIES",
    "CallOptions",
    "ComputeDeviceType",
    "LaunchConfig",
    "PrecisionType",
    "StartMethodType",
    "StartOptions",
    "default_config_path",
    "field_help",
    "field_kind",
    "field_names",
    "field_optional",
    "install_launch_config",
    "installed_launch_config",
    "launch_config",
    "load_config",
    "normalize_precision",
    "resolve_launch_config",
    "save_config",
    "strategy_environment",
    "strategy_fields",
    "write_basic_config",
]
