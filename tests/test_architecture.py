"""The package layout holds: layers point only down, and nothing imports in a cycle.

Every module's imports are read with ``ast`` -- module-level and inside functions
alike -- so a cycle hidden behind a function-level import fails here too. The rules
are DESIGN.md's table ("may import") for each folder of ``nbaccel/``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nbaccel"

# layer -> layers it may import (itself always allowed); "" is a top-level module.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_version": set(),
    "platform": {"errors"},
    "config": {"errors", "platform"},
    "checkpoint": {"errors", "_version", "platform"},
    "tracking": {"errors", "platform"},
    "runtime": {"errors", "_version", "platform", "config", "checkpoint", "tracking"},
    "launch": {"errors", "_version", "platform", "config", "tracking", "runtime"},
    "ui": {"errors", "platform", "config", "launch"},
    "cli": {"errors", "_version", "platform", "config", "launch"},
}
# Public names at their old or Accelerate-like paths: they only re-export (anything below them).
ROOT_MODULES = {
    "__init__",
    "__main__",
    "accelerate",
    "accelerator",
    "data_loader",
    "launcher",
    "launchers",
    "local_sgd",
    "logging",
    "monitor",
    "parallelism_config",
    "state",
    "utils",
    "widgets",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported nbaccel module, line) for every import in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nbaccel"):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("nbaccel"):
                continue
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{target}.{alias.name}"
                yield (sub if sub in known else target), node.lineno


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return ""  # the package root
    if parts[1] in ROOT_MODULES:  # a name-only module, or package (utils/: its submodules)
        return ""
    return parts[1]


def graph() -> dict[str, set[tuple[str, int]]]:
    found = modules()
    known = set(found)
    return {name: set(imports_of(name, path, known)) for name, path in found.items()}


def test_every_module_is_in_a_known_layer() -> None:
    for name in modules():
        top = layer(name)
        assert top == "" or top in ALLOWED, (
            f"{name} is in no layer of DESIGN.md: move it into one of {sorted(ALLOWED)} "
            "or add its folder to the table (and to DESIGN.md)."
        )


def test_layers_only_point_down() -> None:
    problems = []
    for name, edges in graph().items():
        source = layer(name)
        if source == "":
            continue  # the root and the thin aliases re-export from any layer
        for target, line in sorted(edges):
            dest = layer(target)
            if dest == source:
                continue
            if dest == "" or dest not in ALLOWED[source]:
                problems.append(f"{name}:{line} imports {target} ({source} -> {dest or 'root'})")
    assert not problems, "imports that break DESIGN.md's layering:\n" + "\n".join(problems)


def test_no_import_cycles() -> None:
    edges = {name: {t for t, _ in targets} for name, targets in graph().items()}
    # A package's __init__ that re-exports its submodules is not a cycle with them:
    # a submodule importing a sibling never needs the package's own re-exports.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in edges or nxt == node:
                continue
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # package <-> its own submodule
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


#: No module of one concept here has needed more (the Accelerator facade, the largest, has
#: about 550 lines); a file past it holds several jobs, whatever its docstring says.
CEILING = 600


def one_job_problems(name: str, path: Path) -> list[str]:
    """Why ``path`` does not show one job (an empty list: it does)."""
    text = path.read_text()
    problems = []
    if (lines := len(text.splitlines())) > CEILING:
        problems.append(f"{name}: {lines} lines (ceiling {CEILING}): it does several jobs")
    doc = ast.get_docstring(ast.parse(text))
    summary = (doc or "").strip().split("\n\n")[0]
    if not summary or len(summary.splitlines()) > 2 or not summary.endswith("."):
        problems.append(f"{name}: its docstring's summary must name its one job {summary!r}")
    return problems


def test_each_module_has_one_job_named_in_its_docstring(tmp_path: Path) -> None:
    """One concept per module (DESIGN.md habit 1), checked as such rather than as a line
    count. A hard 400-line limit made modules split where the count said, not where a
    concept ends (the supervisor was cut in two at 406 lines, its halves sharing state
    through inheritance). So: every module opens with a docstring whose summary (its
    first paragraph, at most two lines, one statement ending in a period) names the job
    it does, which review holds the code to; and a generous ceiling catches a file that
    grew into several jobs. Split along a concept, never to pass a number."""
    problems = [p for name, path in modules().items() for p in one_job_problems(name, path)]
    assert not problems, "modules that do not show one job:\n" + "\n".join(problems)
    facade = len((PACKAGE / "runtime" / "accelerator.py").read_text().splitlines())
    assert facade < 600, f"the Accelerator facade has {facade} lines; delegate to runtime modules"
    # the checker can fail: no docstring, a summary that lists jobs, a file past the ceiling
    bad = tmp_path / "bad.py"
    for text in ["x = 1\n", '"""Reads,\nwrites,\nand draws."""\n', '"""One job."""\n' * 601]:
        bad.write_text(text)
        assert one_job_problems("bad", bad), text


def test_facade_has_no_distributed_type_ladder() -> None:
    tree = ast.parse((PACKAGE / "runtime" / "accelerator.py").read_text())
    comparisons = [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Compare) and "distributed_type" in ast.unparse(node))
        or (isinstance(node, ast.Compare) and "DistributedType." in ast.unparse(node))
    ]
    assert not comparisons, f"runtime/accelerator.py compares distributed types at {comparisons}"


def test_the_checker_sees_function_level_imports(tmp_path: Path) -> None:
    # guard against a checker that cannot fail: a function-level upward import is found
    fake = tmp_path / "nbaccel" / "runtime" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ..launch import launcher\n")
    found = set(imports_of("nbaccel.runtime.x", fake, {"nbaccel.launch.launcher"}))
    assert ("nbaccel.launch.launcher", 2) in found
    assert layer("nbaccel.launch.launcher") not in ALLOWED["runtime"]
