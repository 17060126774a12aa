"""Rewrite imports of the runtime's old module paths (before its folders) to the new ones.

For merging work written against the flat ``nbaccel/runtime/`` (f5fb9ad and before):
each given file's imports -- relative ones resolved from where the file sits, absolute
ones, ``from nbaccel.runtime import x`` and dotted strings (``"nbaccel.runtime.state.X"``
in ``monkeypatch.setattr``, lazy-name maps such as ``"runtime.options"``) -- are pointed
at the modules' new homes. Files are rewritten in place; nothing else is touched. Run it on
files written against the old layout only (a new-style ``from ..strategy.fsdp import x``
would be read as the old module). In a file that moved, lines another branch added with
old relative imports are not seen as such: ``mypy nbaccel`` and tests/test_import.py name them.

Example:
    $ python scripts/runtime_moves.py nbaccel/runtime/parallel/*.py tests/parallel/*.py
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: old module -> new module (``git diff f5fb9ad -M --name-status -- nbaccel/runtime``)
MOVED = {
    "nbaccel.runtime.availability": "nbaccel.runtime.accelerate_utils.availability",
    "nbaccel.runtime.compat": "nbaccel.runtime.accelerate_utils.compat",
    "nbaccel.runtime.helpers": "nbaccel.runtime.accelerate_utils.helpers",
    "nbaccel.runtime.logging_adapter": "nbaccel.runtime.accelerate_utils.logging_adapter",
    "nbaccel.runtime.not_applicable": "nbaccel.runtime.accelerate_utils.not_applicable",
    "nbaccel.runtime._packed_gather": "nbaccel.runtime.collectives._packed_gather",
    "nbaccel.runtime.ops": "nbaccel.runtime.collectives.ops",
    "nbaccel.runtime.splitting": "nbaccel.runtime.collectives.splitting",
    "nbaccel.runtime.tree": "nbaccel.runtime.collectives.tree",
    "nbaccel.runtime.triggers": "nbaccel.runtime.collectives.triggers",
    "nbaccel.runtime.dynamo": "nbaccel.runtime.compute.dynamo",
    "nbaccel.runtime.fp8": "nbaccel.runtime.compute.fp8",
    "nbaccel.runtime.precision": "nbaccel.runtime.compute.precision",
    "nbaccel.runtime._accelerate_attrs": "nbaccel.runtime.facade._accelerate_attrs",
    "nbaccel.runtime._checkpoint_api": "nbaccel.runtime.facade._checkpoint_api",
    "nbaccel.runtime._collective_api": "nbaccel.runtime.facade._collective_api",
    "nbaccel.runtime._process_api": "nbaccel.runtime.facade._process_api",
    "nbaccel.runtime._tracking_api": "nbaccel.runtime.facade._tracking_api",
    "nbaccel.runtime.accelerator": "nbaccel.runtime.facade.accelerator",
    "nbaccel.runtime.options": "nbaccel.runtime.facade.options",
    "nbaccel.runtime.partial_state": "nbaccel.runtime.facade.partial_state",
    "nbaccel.runtime.profiling": "nbaccel.runtime.facade.profiling",
    "nbaccel.runtime.selfcheck": "nbaccel.runtime.facade.selfcheck",
    "nbaccel.runtime._epoch_rng": "nbaccel.runtime.loading._epoch_rng",
    "nbaccel.runtime._loader_parts": "nbaccel.runtime.loading._loader_parts",
    "nbaccel.runtime._loader_state": "nbaccel.runtime.loading._loader_state",
    "nbaccel.runtime.data": "nbaccel.runtime.loading.data",
    "nbaccel.runtime.dispatch": "nbaccel.runtime.loading.dispatch",
    "nbaccel.runtime.join": "nbaccel.runtime.loading.join",
    "nbaccel.runtime.sharding": "nbaccel.runtime.loading.sharding",
    "nbaccel.runtime.rank_check": "nbaccel.runtime.process.rank_check",
    "nbaccel.runtime.rng": "nbaccel.runtime.process.rng",
    "nbaccel.runtime.state": "nbaccel.runtime.process.state",
    "nbaccel.runtime._checkpoint_collective": "nbaccel.runtime.saving._checkpoint_collective",
    "nbaccel.runtime._checkpoint_write": "nbaccel.runtime.saving._checkpoint_write",
    "nbaccel.runtime.checkpointing": "nbaccel.runtime.saving.checkpointing",
    "nbaccel.runtime.hooks": "nbaccel.runtime.saving.hooks",
    "nbaccel.runtime.model_io": "nbaccel.runtime.saving.model_io",
    "nbaccel.runtime.sharded_state": "nbaccel.runtime.saving.sharded_state",
    "nbaccel.runtime.comm_hooks": "nbaccel.runtime.strategy.ddp.comm_hooks",
    "nbaccel.runtime.strategy.ddp": "nbaccel.runtime.strategy.ddp.ddp",
    "nbaccel.runtime._deepspeed_config": "nbaccel.runtime.strategy.deepspeed._deepspeed_config",
    "nbaccel.runtime._deepspeed_prepare": "nbaccel.runtime.strategy.deepspeed._deepspeed_prepare",
    "nbaccel.runtime.strategy.deepspeed": "nbaccel.runtime.strategy.deepspeed.deepspeed",
    "nbaccel.runtime.deepspeed_plugin": "nbaccel.runtime.strategy.deepspeed.deepspeed_plugin",
    "nbaccel.runtime.strategy._fsdp_wrap": "nbaccel.runtime.strategy.fsdp._fsdp_wrap",
    "nbaccel.runtime.strategy.fsdp": "nbaccel.runtime.strategy.fsdp.fsdp",
    "nbaccel.runtime.fsdp_plugin": "nbaccel.runtime.strategy.fsdp.fsdp_plugin",
    "nbaccel.runtime.strategy.xla": "nbaccel.runtime.strategy.xla.xla",
    "nbaccel.runtime.accumulation": "nbaccel.runtime.training.accumulation",
    "nbaccel.runtime.local_sgd": "nbaccel.runtime.training.local_sgd",
    "nbaccel.runtime.wrappers": "nbaccel.runtime.training.wrappers",
}
#: modules removed, and what to import instead (by hand: the names changed)
REMOVED = {
    "nbaccel.runtime.xla": "nbaccel.platform.tpu (require_backend().device(), after_step(), ...)",
    "nbaccel.platform.xla": "nbaccel.platform.tpu (xla_requested, xla_available, ...)",
    "nbaccel.platform.tpu.registry": "nbaccel.platform.tpu",
}


def module_of(path: Path) -> str:
    parts = list(path.resolve().relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def relative(from_package: str, target: str) -> str:
    """``target`` as a relative import from ``from_package``."""
    a, b = from_package.split("."), target.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return "." * (len(a) - common + 1) + ".".join(b[common:])


def _new(old: str) -> str:
    """The new home of ``old`` (a module, or a name inside one)."""
    for src in sorted(MOVED, key=len, reverse=True):
        if old == src or old.startswith(src + "."):
            return MOVED[src] + old[len(src) :]
    return old


def rewrite(path: Path) -> list[str]:
    """Rewrite ``path``'s imports in place; return what could not be rewritten."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    name = module_of(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    problems = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ImportFrom) or not (node.level or node.module):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if not target.startswith("nbaccel"):
            continue
        if target in REMOVED:
            problems.append(f"{path}:{node.lineno}: {target} is gone: use {REMOVED[target]}")
            continue
        modules = [a.name for a in node.names if f"{target}.{a.name}" in MOVED]
        if modules:  # `from pkg import module`: the module's new parent
            parents = {_new(f"{target}.{m}").rpartition(".")[0] for m in modules}
            if len(parents) != 1 or len(modules) != len(node.names):
                problems.append(f"{path}:{node.lineno}: split this import by hand")
                continue
            new_target = parents.pop()
        else:
            new_target = _new(target)
        if new_target == target:
            continue
        head = relative(package, new_target) if node.level else new_target
        line = lines[node.lineno - 1]
        lines[node.lineno - 1] = re.sub(
            r"from\s+[.\w]+\s+import", f"from {head} import", line, count=1
        )
    text = "".join(lines)
    dotted = re.compile(r"(?<![\w.])(nbaccel\.runtime(?:\.\w+)+)")
    text = dotted.sub(lambda m: _new(m.group(1)), text)
    lazy = re.compile(r"([\"'])(runtime(?:\.\w+)+)([\"'])")
    text = lazy.sub(lambda m: m[1] + _new("nbaccel." + m[2])[len("nbaccel.") :] + m[3], text)
    path.write_text(text)
    return problems


def main(argv: list[str]) -> int:
    problems = [p for name in argv for p in rewrite(Path(name))]
    print("\n".join(problems) or f"rewrote {len(argv)} file(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
