"""Extract the Accelerate API that training scripts use, and check it against nbaccel.

Two steps, one file:

* ``python docs/api-scan/scan.py extract FILE... --source NAME`` parses each file with
  :mod:`ast` and prints, as JSON, the Accelerate names it uses (keys of the form below).
  Third-party files are read, never stored: only the keys go into ``usage.json``.
* ``python docs/api-scan/scan.py check`` reads ``usage.json`` and checks every key against
  nbaccel (with ``accelerate`` mapped to ``nbaccel``), printing the keys that do not resolve
  and the number of files whose keys all resolve.

Keys:

* ``accelerate.utils.X`` -- a name imported from, or read as an attribute of, a module;
* ``accelerate.utils.X(kw=)`` -- a keyword passed to that callable;
* ``Accelerator.save_state`` -- an attribute read (or method called) on an instance;
* ``Accelerator.save_state(kw=)`` -- a keyword passed to that method;
* ``Accelerator.gradient_accumulation_steps=`` -- an attribute assigned on an instance.

Instances are tracked through assignments (``acc = Accelerator(...)``, ``state =
PartialState()``, ``logger = get_logger(__name__)``), ``with ... as`` and the names
``accelerator`` / ``self.accelerator`` (how scripts pass it around).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import sys
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent

# what an attribute of a known instance is (accelerator.state -> an AcceleratorState)
ATTRIBUTE_TYPES = {
    ("Accelerator", "state"): "AcceleratorState",
    ("Accelerator", "gradient_state"): "GradientState",
}
# what a call returns, when it is an instance we follow
CALL_TYPES = {
    "accelerate.logging.get_logger": "MultiProcessAdapter",
}
CONVENTIONAL = {"accelerator": "Accelerator"}


class _Scanner(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> accelerate path (module or object)
        self.instances: dict[str, str] = {}  # unparsed expression -> class name
        self.uses: set[str] = set()

    # ---- imports -------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "accelerate" or alias.name.startswith("accelerate."):
                if alias.asname:
                    self.aliases[alias.asname] = alias.name
                else:
                    self.aliases["accelerate"] = "accelerate"
                if alias.name != "accelerate":
                    self.uses.add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and (module == "accelerate" or module.startswith("accelerate.")):
            for alias in node.names:
                path = f"{module}.{alias.name}"
                self.aliases[alias.asname or alias.name] = path
                self.uses.add(path)

    # ---- expressions ---------------------------------------------------------------------
    def _resolve(self, node: ast.AST) -> str | None:
        """'mod:accelerate.x' for an accelerate path, 'inst:Cls' for a tracked instance."""
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return "mod:" + self.aliases[node.id]
            if node.id in self.instances:
                return "inst:" + self.instances[node.id]
            if node.id in CONVENTIONAL and self.aliases:
                return "inst:" + CONVENTIONAL[node.id]
            return None
        if isinstance(node, ast.Attribute):
            key = ast.unparse(node)
            if key in self.instances:
                return "inst:" + self.instances[key]
            # self.accelerator (not trainer.accelerator: transformers builds its own)
            is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if node.attr in CONVENTIONAL and is_self and self.aliases:
                return "inst:" + CONVENTIONAL[node.attr]
            base = self._resolve(node.value)
            if base is None:
                if not isinstance(node.value, (ast.Name, ast.Attribute, ast.Call)):
                    self.visit(node.value)
                return None
            kind, path = base.split(":", 1)
            if kind == "mod":
                self.uses.add(f"{path}.{node.attr}")
                return f"mod:{path}.{node.attr}"
            self.uses.add(f"{path}.{node.attr}")
            sub = ATTRIBUTE_TYPES.get((path, node.attr))
            return f"inst:{sub}" if sub else f"meth:{path}.{node.attr}"
        if isinstance(node, ast.Call):
            return self._call(node)
        return None

    def _call(self, node: ast.Call) -> str | None:
        func = self._resolve(node.func)
        for arg in node.args:
            self.visit(arg)
        for kw in node.keywords:
            self.visit(kw.value)
        if func is None:
            return None
        kind, path = func.split(":", 1)
        if kind == "inst":  # calling an instance (rare): nothing to record
            return None
        for kw in node.keywords:
            if kw.arg is not None:
                self.uses.add(f"{path}({kw.arg}=)")
        if kind == "mod":
            if path in CALL_TYPES:
                return "inst:" + CALL_TYPES[path]
            last = path.rsplit(".", 1)[-1]
            if last[:1].isupper():
                return "inst:" + last
        return None

    def visit_Name(self, node: ast.Name) -> None:
        self._resolve(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Store):
            base = self._resolve(node.value)
            if base and base.startswith("inst:"):
                self.uses.add(f"{base[5:]}.{node.attr}=")
            return
        self._resolve(node)

    def visit_Call(self, node: ast.Call) -> None:
        self._resolve(node)

    # ---- bindings ------------------------------------------------------------------------
    def _bind(self, target: ast.AST, value: ast.AST | None) -> None:
        resolved = self._resolve(value) if value is not None else None
        if (
            resolved
            and resolved.startswith("inst:")
            and isinstance(target, (ast.Name, ast.Attribute))
        ):
            self.instances[ast.unparse(target)] = resolved[5:]
        self.visit(target)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._bind(node.target, node.value)

    def visit_withitem(self, node: ast.withitem) -> None:
        if node.optional_vars is not None:
            self._bind(node.optional_vars, node.context_expr)
        else:
            self.visit(node.context_expr)

    def visit_arg(self, node: ast.arg) -> None:
        # def f(accelerator: Accelerator) / def f(state: PartialState)
        if node.annotation is not None:
            resolved = self._resolve(node.annotation)
            if resolved and resolved.startswith("mod:"):
                last = resolved.rsplit(".", 1)[-1]
                if last[:1].isupper():
                    self.instances[node.arg] = last


def extract(source: str) -> list[str]:
    """The Accelerate keys a Python source uses (empty when it does not import accelerate).

    Example:
        >>> extract("from accelerate import Accelerator\\nAccelerator(cpu=True).wait_for_everyone()")
        ['Accelerator.wait_for_everyone', 'accelerate.Accelerator', 'accelerate.Accelerator(cpu=)']
    """
    tree = ast.parse(source)
    scanner = _Scanner()
    # imports first (they may sit below their first use, inside functions)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            scanner.visit(node)
    if not scanner.aliases:
        return []
    scanner.visit(tree)
    return sorted(_normalise(k) for k in scanner.uses)


def _normalise(key: str) -> str:
    # accelerator.state.X is AcceleratorState.X; Accelerator.state stays as read
    return key


# ---- checking against nbaccel ----------------------------------------------------------------
def _nb_object(path: str) -> object:
    """Resolve 'accelerate.a.b' as 'nbaccel.a.b' (module, then attributes); raise if missing."""
    parts = ["nbaccel", *path.split(".")[1:]]
    obj: object = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _instances() -> dict[str, object]:
    import nbaccel
    from nbaccel.logging import get_logger

    accelerator = nbaccel.Accelerator(cpu=True)
    return {
        "Accelerator": accelerator,
        "AcceleratorState": accelerator.state,
        "PartialState": nbaccel.PartialState(),
        "GradientState": getattr(accelerator, "gradient_state", None),
        "MultiProcessAdapter": get_logger("scan"),
        "LocalSGD": _optional("nbaccel.local_sgd", "LocalSGD"),
    }


def _optional(module: str, name: str) -> object:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _accepts(func: object, kw: str) -> bool:
    try:
        params = inspect.signature(func).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True  # builtins: cannot tell
    if kw in params:
        return params[kw].kind is not inspect.Parameter.POSITIONAL_ONLY
    # **kwargs: accepted by the signature (what it does with them is the runtime tests' job)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_key(key: str, instances: dict[str, object]) -> str | None:
    """None when nbaccel has what ``key`` uses, else a short reason."""
    kw = None
    if key.endswith("=)"):
        key, kw = key[:-2].split("(")
    setter = key.endswith("=")
    key = key.rstrip("=")
    head, _, attr = key.partition(".")
    try:
        if head == "accelerate":
            obj = _nb_object(key)
        else:
            if head not in instances or instances[head] is None:
                return f"no {head} instance"
            inst = instances[head]
            if setter:
                if not hasattr(inst, attr):
                    return "no such attribute (an assignment would add it silently)"
                prop = getattr(type(inst), attr, None)
                if isinstance(prop, property) and prop.fset is None:
                    return "read-only property"
                return None
            obj = getattr(inst, attr)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:120]
    if kw is not None:
        target = obj.__init__ if inspect.isclass(obj) else obj  # type: ignore[misc]
        if not _accepts(target, kw):
            return f"keyword {kw!r} not accepted"
    return None


def _load_usage() -> dict:
    return json.loads((HERE / "usage.json").read_text())


def cmd_check(args: argparse.Namespace) -> int:
    usage = _load_usage()
    instances = _instances()
    bad: dict[str, str] = {}
    for key in usage["keys"]:
        reason = check_key(key, instances)
        if reason is not None:
            bad[key] = reason
    files = usage["files"]
    ok_files = [f for f, keys in files.items() if not any(k in bad for k in keys)]
    # accelerate.test_utils is imported only under TESTING_MOCKED_DATALOADERS=1 (Accelerate's CI)
    ok_real = [
        f
        for f, keys in files.items()
        if not any(k in bad and not k.startswith("accelerate.test_utils.") for k in keys)
    ]
    print(f"files scanned: {len(files)}; all names resolve in nbaccel: {len(ok_files)}")
    print(f"... not counting accelerate.test_utils (Accelerate's own CI hook): {len(ok_real)}")
    print(f"keys: {len(usage['keys'])}; unresolved: {len(bad)}")
    for key, reason in sorted(bad.items(), key=lambda kv: -usage["keys"][kv[0]]["count"]):
        print(f"{usage['keys'][key]['count']:4d}  {key}  -- {reason}")
    if args.json:
        out = {
            k: {"count": usage["keys"][k]["count"], "reason": r, "files": usage["keys"][k]["files"]}
            for k, r in bad.items()
        }
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True))
    return 0


def _merge(into: dict, per_file: dict[str, Iterable[str]]) -> None:
    for name, keys in per_file.items():
        into["files"][name] = sorted(set(keys))
    counts: dict[str, list[str]] = {}
    for name, keys in into["files"].items():
        for key in keys:
            counts.setdefault(key, []).append(name)
    into["keys"] = {k: {"count": len(v), "files": sorted(v)} for k, v in sorted(counts.items())}


def cmd_extract(args: argparse.Namespace) -> int:
    per_file = {}
    for path in args.files:
        rel = f"{args.source}:{path.split(args.strip, 1)[-1] if args.strip else path}"
        keys = extract(Path(path).read_text())
        if keys:
            per_file[rel] = keys
    usage = _load_usage() if (HERE / "usage.json").exists() else {"files": {}, "keys": {}}
    _merge(usage, per_file)
    (HERE / "usage.json").write_text(json.dumps(usage, indent=1, sort_keys=True) + "\n")
    print(f"{len(per_file)} files with accelerate names added")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    """Add keys extracted by reading a file (for files read through a search tool)."""
    per_file = json.loads(Path(args.json).read_text())
    usage = _load_usage() if (HERE / "usage.json").exists() else {"files": {}, "keys": {}}
    _merge(usage, per_file)
    (HERE / "usage.json").write_text(json.dumps(usage, indent=1, sort_keys=True) + "\n")
    print(f"{len(per_file)} files added")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract")
    ex.add_argument("files", nargs="+")
    ex.add_argument("--source", required=True, help="e.g. huggingface/trl@1.16.0")
    ex.add_argument("--strip", default="", help="path prefix to drop")
    ex.set_defaults(fn=cmd_extract)
    add = sub.add_parser("add")
    add.add_argument("json")
    add.set_defaults(fn=cmd_add)
    ch = sub.add_parser("check")
    ch.add_argument("--json", default="")
    ch.set_defaults(fn=cmd_check)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
