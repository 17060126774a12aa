"""Accelerate's config file (written by ``accelerate config``) read as LaunchConfig values.

A file holding ``distributed_type`` or ``compute_environment`` is Accelerate's; every key
of it is looked up in :data:`ACCELERATE_KEYS` (and ``fsdp_config`` / ``deepspeed_config``
entries in :data:`FSDP_KEYS` / :data:`DEEPSPEED_KEYS`): one row per key says what it
becomes here. A key, or a value, that nbaccel cannot honour, where ignoring it would
change what runs, is a :class:`~nbaccel.errors.ConfigError` naming the key, the file and
the fix. Accelerate's ``num_processes`` counts every machine's processes; nbaccel's
counts one machine's, so it is divided by ``num_machines``.

Example:
    >>> values = accelerate_values(
    ...     {"distributed_type": "MULTI_CPU", "num_processes": 4, "num_machines": 2,
    ...      "machine_rank": 1, "main_process_ip": "10.0.0.1", "main_process_port": 29500},
    ...     "accel.yaml")
    >>> values["num_processes"], values["num_nodes"], values["compute_device"]
    (2, 2, 'cpu')
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .choices import RDZV_BACKENDS
from .launch_config import PARALLELISM_SIZE_FIELDS


class _Refused(Exception):
    """A value nbaccel cannot honour; the text is the reason and the fix."""


class _Named(_Refused):
    """A refusal whose text already names the key (a nested section's)."""


@dataclass(frozen=True)
class KeyRule:
    """What one Accelerate key becomes: ``becomes`` for people (the README's table),
    ``translate(value, whole_section)`` for the code: ``{LaunchConfig field: value}``."""

    becomes: str
    translate: Callable[[Any, Mapping[str, Any]], dict[str, Any]]


def _to(field: str) -> Callable[[Any, Mapping[str, Any]], dict[str, Any]]:
    return lambda value, _: {} if value is None else {field: value}


def _ignored(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _only(*accepted: Any, fix: str) -> Callable[[Any, Mapping[str, Any]], dict[str, Any]]:
    """Accepted (changing nothing) when the value is one of ``accepted``, else refused."""

    def check(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        text = value.strip().upper() if isinstance(value, str) else value
        if text in accepted or (isinstance(value, list | dict) and not value):
            return {}
        raise _Refused(fix)

    return check


# distributed_type -> (strategy, compute_device); None: left to the other keys / "auto"
_DISTRIBUTED: dict[str, tuple[str, str | None]] = {
    "NO": ("ddp", None),
    "MULTI_CPU": ("ddp", "cpu"),
    "MULTI_GPU": ("ddp", "gpu"),
    "FSDP": ("fsdp", None),
    "DEEPSPEED": ("deepspeed", None),
    "XLA": ("ddp", "tpu"),
    "TPU": ("ddp", "tpu"),  # the name before Accelerate 0.25
}


def _distributed_type(value: Any, section: Mapping[str, Any]) -> dict[str, Any]:
    kind = str(value).strip().upper()
    if kind not in _DISTRIBUTED:
        raise _Refused(
            "nbaccel runs DDP, FSDP2 and DeepSpeed on CPUs, CUDA GPUs and TPUs only; "
            f"use one of {', '.join(_DISTRIBUTED)} (or `accelerate launch` for {kind})"
        )
    strategy, device = _DISTRIBUTED[kind]
    out: dict[str, Any] = {"strategy": strategy}
    if device is not None and not section.get("use_cpu"):
        out["compute_device"] = device
    if kind == "NO" and section.get("num_processes") in (None, -1):
        out["num_processes"] = 1  # Accelerate's default for NO
    return out


def _num_processes(value: Any, section: Mapping[str, Any]) -> dict[str, Any]:
    if value is None or value == -1:  # -1: Accelerate's "not set" (e.g. SLURM passes it)
        return {}
    machines = section.get("num_machines") or 1
    if not isinstance(value, int) or isinstance(value, bool) or not isinstance(machines, int):
        return {"num_processes": value}  # LaunchConfig's check names the bad value
    if value % machines:
        raise _Refused(
            f"Accelerate's num_processes counts all machines' processes ({value}), and "
            f"{value} processes do not split evenly over num_machines={machines}; "
            "make num_processes a multiple of num_machines"
        )
    return {"num_processes": value // machines}


def _use_cpu(value: Any, section: Mapping[str, Any]) -> dict[str, Any]:
    return {"compute_device": "cpu"} if value is True else {}


def _debug(value: Any, section: Mapping[str, Any]) -> dict[str, Any]:
    # Accelerate's debug mode makes mismatched collectives fail instead of hang: nbaccel's
    # debug_collectives does that (torch's check), but on gloo torch's DDP crashes under that
    # check (nbaccel refuses it there), so on the CPU only debug (stacks on hangs) is set.
    if value is not True:
        return {}
    kind = str(section.get("distributed_type", "")).strip().upper()  # as _distributed_type
    on_cpu = section.get("use_cpu") is True or kind in ("NO", "MULTI_CPU")
    return {"debug": True} if on_cpu else {"debug": True, "debug_collectives": True}


def _gpu_ids(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    return {} if value is None else {"gpu_ids": str(value).replace(" ", "")}


def _dynamo(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    backend = value.get("dynamo_backend", "NO") if isinstance(value, dict) else value
    if str(backend).strip().upper() in ("NO", "NONE"):
        return {}
    raise _Refused(
        f"a launch setting cannot compile the model ({backend!r}) here; remove the key and "
        f"write Accelerator(dynamo_backend={str(backend).lower()!r}) in the script"
    )


def _fp16(value: Any, section: Mapping[str, Any]) -> dict[str, Any]:
    return {"mixed_precision": "fp16"} if value is True and "mixed_precision" not in section else {}


def _section(
    table: Mapping[str, KeyRule], name: str
) -> Callable[[Any, Mapping[str, Any]], dict[str, Any]]:
    """A nested mapping (``fsdp_config``, ``deepspeed_config``) translated by its own table."""

    def translate(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise _Refused(f"{name} must be a mapping of key: value")
        return _apply(table, value, prefix=f"{name}.")

    return translate


_EMPTY_FIX = "nbaccel has no such feature; remove the key (or leave it empty)"


def _off(*, fix: str) -> Callable[[Any, Mapping[str, Any]], dict[str, Any]]:
    """Accepted when a section is empty or every entry is off (``ipex_config: {ipex: false}``,
    which older ``accelerate config`` wrote for CPUs), else refused."""

    def check(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        entries = value.values() if isinstance(value, dict) else [value]
        if all(v in (None, False, "", [], {}) for v in entries):
            return {}
        raise _Refused(fix)

    return check


# FSDP: nbaccel runs FSDP2 (fully_shard), Accelerate's fsdp_version 2; of version 1's
# options those with an FSDP2 equivalent are translated, the others refused.
_SHARDING = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}


def _sharding(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(value, bool):  # fsdp_reshard_after_forward in fsdp_version 2
        return {"fsdp_reshard_after_forward": value}
    text = str(value).strip().upper()
    if text not in _SHARDING:
        raise _Refused(
            f"FSDP2 shards fully (FULL_SHARD) or keeps parameters gathered after forward "
            f"(SHARD_GRAD_OP); {text} has no equivalent here: use one of those, or "
            "distributed_type MULTI_GPU for NO_SHARD"
        )
    return {"fsdp_reshard_after_forward": _SHARDING[text]}


def _wrap_policy(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    return {"fsdp_auto_wrap_policy": str(value).strip().lower()}


def _state_dict_type(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if str(value).strip().upper() == "LOCAL_STATE_DICT":
        raise _Refused("FSDP2 has no LOCAL_STATE_DICT; use SHARDED_STATE_DICT")
    return {"fsdp_state_dict_type": value}


def _rank0_weights(value: Any, section: Mapping[str, Any]) -> dict[str, Any]:
    # Version 1's sync_module_states broadcasts rank 0's weights at wrap time; FSDP2 here
    # does that with cpu_ram_efficient_loading (also when every rank holds real weights).
    keys = ("fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states")
    if any(section.get(key) is True for key in keys):
        return {"fsdp_cpu_ram_efficient_loading": True}
    return {} if value is None else {"fsdp_cpu_ram_efficient_loading": value}


def _fsdp_version(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value in (1, 2, "1", "2"):
        return {}  # 1: its options below are translated to FSDP2's or refused
    raise _Refused("use fsdp_version 2 (nbaccel runs FSDP2)")


PARALLELISM_KEYS: dict[str, KeyRule] = {
    name: KeyRule(name, _to(name)) for name in PARALLELISM_SIZE_FIELDS
}
FSDP_KEYS: dict[str, KeyRule] = {
    "fsdp_version": KeyRule("accepted (1 or 2): nbaccel runs FSDP2", _fsdp_version),
    "fsdp_sharding_strategy": KeyRule(
        "FULL_SHARD: fsdp_reshard_after_forward=true; SHARD_GRAD_OP: false; others refused",
        _sharding,
    ),
    "fsdp_reshard_after_forward": KeyRule(
        "fsdp_reshard_after_forward (a version 1 strategy name as above)", _sharding
    ),
    "fsdp_offload_params": KeyRule("fsdp_cpu_offload", _to("fsdp_cpu_offload")),
    "fsdp_auto_wrap_policy": KeyRule("fsdp_auto_wrap_policy (lower case)", _wrap_policy),
    "fsdp_transformer_layer_cls_to_wrap": KeyRule(
        "fsdp_transformer_cls_names_to_wrap", _to("fsdp_transformer_cls_names_to_wrap")
    ),
    "fsdp_min_num_params": KeyRule("fsdp_min_num_params", _to("fsdp_min_num_params")),
    "fsdp_state_dict_type": KeyRule(
        "fsdp_state_dict_type (LOCAL_STATE_DICT refused)", _state_dict_type
    ),
    "fsdp_cpu_ram_efficient_loading": KeyRule(
        "fsdp_cpu_ram_efficient_loading (true also when fsdp_sync_module_states is)",
        _rank0_weights,
    ),
    "fsdp_activation_checkpointing": KeyRule(
        "fsdp_activation_checkpointing", _to("fsdp_activation_checkpointing")
    ),
    "fsdp_sync_module_states": KeyRule(
        "true: fsdp_cpu_ram_efficient_loading=true (every rank starts from rank 0's weights)",
        _rank0_weights,
    ),
    "fsdp_use_orig_params": KeyRule(
        "true accepted (FSDP2 always keeps the parameters); false refused",
        _only(True, None, fix="FSDP2 always keeps the original parameters: set it to true"),
    ),
    "fsdp_backward_prefetch": KeyRule(
        "accepted: FSDP2 prefetches by itself (speed only)", _ignored
    ),
    "fsdp_forward_prefetch": KeyRule("accepted: as above", _ignored),
}


def _nvme_path(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value in (None, "", "none", "None"):
        return {}
    raise _Refused("set the nvme path in a DeepSpeed JSON given as deepspeed_config_file")


_DS_LAUNCHER_FIX = (
    "nbaccel launch starts the processes on each machine itself (like 'standard'); "
    "set deepspeed_multinode_launcher: standard and run nbaccel launch on every machine"
)

DEEPSPEED_KEYS: dict[str, KeyRule] = {
    "zero_stage": KeyRule("deepspeed_zero_stage", _to("deepspeed_zero_stage")),
    "offload_optimizer_device": KeyRule(
        "deepspeed_offload_optimizer_device", _to("deepspeed_offload_optimizer_device")
    ),
    "offload_param_device": KeyRule(
        "deepspeed_offload_param_device", _to("deepspeed_offload_param_device")
    ),
    "gradient_clipping": KeyRule("deepspeed_gradient_clipping", _to("deepspeed_gradient_clipping")),
    "gradient_accumulation_steps": KeyRule(
        "gradient_accumulation_steps", _to("gradient_accumulation_steps")
    ),
    "deepspeed_config_file": KeyRule("deepspeed_config_file", _to("deepspeed_config_file")),
    "offload_optimizer_nvme_path": KeyRule("refused unless none", _nvme_path),
    "offload_param_nvme_path": KeyRule("refused unless none", _nvme_path),
    "zero3_init_flag": KeyRule(
        "false accepted; true refused",
        _only(
            False, None, fix="nbaccel builds the model outside deepspeed.zero.Init: set it false"
        ),
    ),
    "zero3_save_16bit_model": KeyRule(
        "false accepted; true refused",
        _only(
            False,
            None,
            fix="use the stage3_gather_16bit_weights_on_model_save of a "
            "deepspeed_config_file, or set it false",
        ),
    ),
    "deepspeed_multinode_launcher": KeyRule(
        "standard accepted; others refused", _only("STANDARD", None, fix=_DS_LAUNCHER_FIX)
    ),
    "deepspeed_hostfile": KeyRule("refused unless empty", _only(None, "", fix=_DS_LAUNCHER_FIX)),
    "deepspeed_exclusion_filter": KeyRule(
        "refused unless empty", _only(None, "", fix=_DS_LAUNCHER_FIX)
    ),
    "deepspeed_inclusion_filter": KeyRule(
        "refused unless empty", _only(None, "", fix=_DS_LAUNCHER_FIX)
    ),
    "deepspeed_moe_layer_cls_names": KeyRule(
        "refused unless empty", _only(None, "", fix=_EMPTY_FIX)
    ),
}

_TPU_POD_FIX = "nbaccel launch runs on this TPU VM only; set tpu_use_cluster: false"

#: every key of Accelerate's config file and what it becomes in nbaccel
ACCELERATE_KEYS: dict[str, KeyRule] = {
    "compute_environment": KeyRule(
        "LOCAL_MACHINE accepted; others (SageMaker) refused",
        _only(
            "LOCAL_MACHINE",
            fix="nbaccel launches on machines you run it on; use "
            "LOCAL_MACHINE, or `accelerate launch` for AMAZON_SAGEMAKER",
        ),
    ),
    "distributed_type": KeyRule(
        "NO/MULTI_CPU/MULTI_GPU: strategy=ddp (compute_device cpu/gpu), FSDP: fsdp, "
        "DEEPSPEED: deepspeed, XLA/TPU: compute_device=tpu; others refused",
        _distributed_type,
    ),
    "use_cpu": KeyRule("true: compute_device=cpu", _use_cpu),
    "num_processes": KeyRule(
        "num_processes / num_machines (Accelerate counts all machines', nbaccel one's)",
        _num_processes,
    ),
    "num_machines": KeyRule("num_nodes", _to("num_nodes")),
    "machine_rank": KeyRule("node_rank", _to("node_rank")),
    "main_process_ip": KeyRule("master_addr", _to("master_addr")),
    "main_process_port": KeyRule("master_port", _to("master_port")),
    "mixed_precision": KeyRule("mixed_precision", _to("mixed_precision")),
    "fp16": KeyRule("true: mixed_precision=fp16 (older files)", _fp16),
    "gpu_ids": KeyRule('gpu_ids ("all" or "0,1")', _gpu_ids),
    "gradient_accumulation_steps": KeyRule(
        "gradient_accumulation_steps", _to("gradient_accumulation_steps")
    ),
    "debug": KeyRule(
        "true: debug; on GPUs also debug_collectives (on the CPU torch's check crashes DDP)", _debug
    ),
    "rdzv_backend": KeyRule(
        "static, c10d accepted (machines meet at main_process_ip:port); others refused",
        _only(
            *(b.upper() for b in RDZV_BACKENDS),
            None,
            fix=f"use rdzv_backend {' or '.join(RDZV_BACKENDS)}",
        ),
    ),
    "same_network": KeyRule("accepted (no effect on the launch)", _ignored),
    "main_training_function": KeyRule("accepted: the script runs as __main__", _ignored),
    "enable_cpu_affinity": KeyRule(
        "false accepted; true refused",
        _only(False, None, fix="nbaccel does not pin processes to NUMA nodes; set it false"),
    ),
    "downcast_bf16": KeyRule(
        "no/false accepted; others refused",
        _only("NO", False, None, fix="nbaccel does not downcast fp32 to bf16 on TPU; set 'no'"),
    ),
    "dynamo_config": KeyRule("dynamo_backend NO accepted; others refused", _dynamo),
    "dynamo_backend": KeyRule("as dynamo_config (older files)", _dynamo),
    "fsdp_config": KeyRule("the fsdp_* fields (table below)", _section(FSDP_KEYS, "fsdp_config")),
    "parallelism_config": KeyRule(
        "the parallelism_config_* size fields (same names)",
        _section(PARALLELISM_KEYS, "parallelism_config"),
    ),
    "deepspeed_config": KeyRule(
        "the deepspeed_* fields (table below)", _section(DEEPSPEED_KEYS, "deepspeed_config")
    ),
    "tpu_use_cluster": KeyRule(
        "false accepted; true refused", _only(False, None, fix=_TPU_POD_FIX)
    ),
    **{
        key: KeyRule("accepted (used by TPU pods and `accelerate tpu-config` only)", _ignored)
        for key in (
            "tpu_name",
            "tpu_zone",
            "tpu_use_sudo",
            "command_file",
            "commands",
            "tpu_vm",
            "tpu_env",
        )
    },
    "fp8_config": KeyRule(
        "empty accepted; otherwise refused",
        _off(
            fix="nbaccel runs fp8 through torchao: remove it and pass "
            "Accelerator(kwargs_handlers=[AORecipeKwargs(...)]) in the script"
        ),
    ),
    **{
        key: KeyRule("empty (or all false) accepted; otherwise refused", _off(fix=_EMPTY_FIX))
        for key in (
            "tp_config",
            "megatron_lm_config",
            "ipex_config",
            "mpirun_config",
        )
    },
}


def is_accelerate_config(data: Mapping[str, Any]) -> bool:
    """Whether a parsed config file is Accelerate's (nbaccel's has neither key)."""
    return "distributed_type" in data or "compute_environment" in data


def _apply(
    table: Mapping[str, KeyRule], section: Mapping[str, Any], *, prefix: str = ""
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in section.items():
        rule = table.get(key)
        if rule is None:
            raise _Named(
                f"unknown key '{prefix}{key}' (nbaccel knows: {', '.join(table)}); "
                "remove it or write an nbaccel config with `nbaccel config`"
            )
        try:
            out.update(rule.translate(value, section))
        except _Named:
            raise
        except _Refused as why:
            raise _Named(f"{prefix}{key}: {value!r} cannot be honoured here: {why}") from None
    return out


def accelerate_values(data: Mapping[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{LaunchConfig field: raw value}`` from a parsed Accelerate config file.

    Raises:
        ConfigError: a key or value nbaccel cannot honour; names the key, the file, the fix.
    """
    if "distributed_type" not in data:
        raise ConfigError(
            f"Accelerate config file {path} has no distributed_type; add one "
            "(NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED or XLA) or rerun `accelerate config`."
        )
    try:
        return _apply(ACCELERATE_KEYS, data)
    except _Refused as why:
        raise ConfigError(f"Accelerate config file {path}: {why}.") from None


def accelerate_default_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """Accelerate's default config file, if it exists: ``$HF_HOME/accelerate/``, else
    ``$XDG_CACHE_HOME/huggingface/accelerate/``, else ``~/.cache/huggingface/accelerate/``
    (``default_config.yaml``, or the ``.json`` older versions wrote).

    Example:
        >>> accelerate_default_path({"HF_HOME": "/nonexistent"}) is None
        True
    """
    env = os.environ if environ is None else environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    folder = Path(home).expanduser() / "accelerate"
    for name in ("default_config.yaml", "default_config.json"):
        if (folder / name).is_file():
            return folder / name
    return None


__all__ = [
    "ACCELERATE_KEYS",
    "DEEPSPEED_KEYS",
    "FSDP_KEYS",
    "PARALLELISM_KEYS",
    "KeyRule",
    "accelerate_default_path",
    "accelerate_values",
    "is_accelerate_config",
]
