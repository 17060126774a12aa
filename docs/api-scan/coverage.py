"""Draft the rows of docs/api-coverage.md from an installed Accelerate (a maintainer's tool).

``python docs/api-scan/coverage.py`` (with ``accelerate`` installed, e.g. the test extra) writes
``accelerate-signatures.json``: for every public name of Accelerate's documented API listed in
``NAMES`` below, its kind and, for callables, its parameters (name, kind, has a default). The
coverage test reads that file, so it needs no Accelerate at test time. ``--draft`` also prints
a table row per name with the status nbaccel's objects suggest (``same`` when the name resolves
and the signature is compatible, ``gap`` when it is missing); a person then decides each
``differs`` and ``n/a`` row of docs/api-coverage.md.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Accelerate's documented API (its package reference pages: accelerator, state, kwargs,
# plugins/utilities, launchers, logging, tracking, local_sgd, data_loader, big_modeling).
NAMES: dict[str, list[str]] = {
    "accelerate": [
        "Accelerator",
        "PartialState",
        "AutocastKwargs",
        "DataLoaderConfiguration",
        "DDPCommunicationHookType",
        "DeepSpeedPlugin",
        "DistributedDataParallelKwargs",
        "DistributedType",
        "FullyShardedDataParallelPlugin",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "ProfileKwargs",
        "find_executable_batch_size",
        "load_checkpoint_in_model",
        "skip_first_batches",
        "synchronize_rng_states",
        "notebook_launcher",
        "debug_launcher",
        "init_empty_weights",
        "init_on_device",
        "cpu_offload",
        "disk_offload",
        "dispatch_model",
        "load_checkpoint_and_dispatch",
        "infer_auto_device_map",
        "prepare_pippy",
        "__version__",
    ],
    "accelerate.state": [
        "PartialState",
        "AcceleratorState",
        "GradientState",
        "DistributedType",
        "is_initialized",
    ],
    "accelerate.utils": [
        "DistributedType",
        "DynamoBackend",
        "LoggerType",
        "PrecisionType",
        "RNGType",
        "ProjectConfiguration",
        "DataLoaderConfiguration",
        "GradientAccumulationPlugin",
        "DeepSpeedPlugin",
        "FullyShardedDataParallelPlugin",
        "MegatronLMPlugin",
        "TorchDynamoPlugin",
        "TorchTensorParallelPlugin",
        "KwargsHandler",
        "AutocastKwargs",
        "DistributedDataParallelKwargs",
        "DDPCommunicationHookType",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "ProfileKwargs",
        "FP8RecipeKwargs",
        "broadcast",
        "broadcast_object_list",
        "concatenate",
        "convert_outputs_to_fp32",
        "convert_to_fp32",
        "gather",
        "gather_object",
        "listify",
        "pad_across_processes",
        "recursively_apply",
        "reduce",
        "send_to_device",
        "slice_tensors",
        "is_bf16_available",
        "is_ipex_available",
        "is_mps_available",
        "is_npu_available",
        "is_torch_version",
        "is_torch_xla_available",
        "is_xpu_available",
        "is_cuda_available",
        "is_wandb_available",
        "is_tensorboard_available",
        "is_mlflow_available",
        "is_peft_model",
        "is_schedulefree_available",
        "is_rich_available",
        "patch_environment",
        "clear_environment",
        "write_basic_config",
        "find_executable_batch_size",
        "release_memory",
        "get_max_memory",
        "extract_model_from_parallel",
        "save",
        "load",
        "wait_for_everyone",
        "set_seed",
        "synchronize_rng_state",
        "synchronize_rng_states",
        "load_checkpoint_in_model",
        "merge_fsdp_weights",
        "skip_first_batches",
        "compute_module_sizes",
        "infer_auto_device_map",
        "install_xla",
        "load_and_quantize_model",
        "BnbQuantizationConfig",
        "tqdm",
    ],
    "accelerate.launchers": ["notebook_launcher", "debug_launcher"],
    "accelerate.local_sgd": ["LocalSGD"],
    "accelerate.logging": ["get_logger", "MultiProcessAdapter"],
    "accelerate.tracking": [
        "GeneralTracker",
        "on_main_process",
        "TensorBoardTracker",
        "WandBTracker",
        "MLflowTracker",
        "CometMLTracker",
        "AimTracker",
        "ClearMLTracker",
        "DVCLiveTracker",
    ],
    "accelerate.data_loader": [
        "prepare_data_loader",
        "skip_first_batches",
        "DataLoaderShard",
        "DataLoaderDispatcher",
        "BatchSamplerShard",
        "IterableDatasetShard",
        "SeedableRandomSampler",
    ],
}

# classes whose public members are rows of their own: (module, class, instance attributes
# that the class sets in __init__ and scripts read)
MEMBERS: dict[tuple[str, str], list[str]] = {
    ("accelerate", "Accelerator"): [
        "state",
        "gradient_state",
        "trackers",
        "native_amp",
        "scaler",
        "step_scheduler_with_optimizer",
        "project_configuration",
        "rng_types",
        "device_placement",
        "dataloader_config",
    ],
    ("accelerate.state", "PartialState"): [],
    ("accelerate.state", "AcceleratorState"): [],
    ("accelerate.state", "GradientState"): [],
    ("accelerate.local_sgd", "LocalSGD"): [],
    ("accelerate.logging", "MultiProcessAdapter"): [],
}


def _signature(obj: object) -> list[list] | None:
    target = obj.__init__ if inspect.isclass(obj) else obj  # type: ignore[misc]
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    return [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in params]


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.ismodule(obj):
        return "module"
    if isinstance(obj, property):
        return "property"
    if callable(obj):
        return "function"
    return "value"


def collect() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for module_name, names in NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                continue  # not in this Accelerate version
            obj = getattr(module, name)
            out[f"{module_name}.{name}"] = {"kind": _kind(obj), "params": _signature(obj)}
    for (module_name, cls_name), extra in MEMBERS.items():
        cls = getattr(importlib.import_module(module_name), cls_name)
        members = sorted(n for n in dir(cls) if not n.startswith("_")) + extra
        for name in members:
            obj = inspect.getattr_static(cls, name, None)
            kind = "attribute" if obj is None else _kind(obj)
            if isinstance(obj, (staticmethod, classmethod)):
                obj, kind = obj.__func__, "function"
            entry = {"kind": kind, "params": _signature(obj) if kind == "function" else None}
            if entry["params"] and kind == "function":
                entry["params"] = [p for p in entry["params"] if p[0] != "self"]
            out[f"{cls_name}.{name}"] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", action="store_true", help="print draft table rows")
    args = parser.parse_args()
    import accelerate

    data = {"accelerate_version": accelerate.__version__, "names": collect()}
    path = HERE / "accelerate-signatures.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{len(data['names'])} names of accelerate {accelerate.__version__} -> {path}")
    if args.draft:
        import sys

        sys.path.insert(0, str(HERE.parent.parent / "tests"))
        from test_api_coverage import check_row

        for name in data["names"]:
            problem = check_row(name, "same", "")
            print(f"| `{name}` | {'same' if problem is None else 'gap'} | {problem or ''} |")


if __name__ == "__main__":
    main()
