"""Draw one folder of ``nbaccel`` as a house: how many floors (import layers) and arrows (imports).

The room is a folder of the package (``--room``: ``runtime`` by default, ``launch``, ...).
Units are its folders by concept (a module left at the room's top is its own unit; a folder
with sub-folders, such as ``runtime/strategy/`` or ``launch/start/``, is one); ``--modules``
counts single modules instead. Imports from outside the room are not drawn. An arrow is "unit A imports unit B" (A != B), at any depth of the file (function-level
imports too); the floors are the longest chain of arrows plus one, after folding cycles
into one floor (a cycle is reported, as the units it joins).

Example:
    $ python scripts/house.py                      # nbaccel/runtime of this checkout
    $ python scripts/house.py --room launch        # nbaccel/launch
    $ python scripts/house.py --modules /tmp/old/nbaccel
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def _modules(package: Path, room: str) -> dict[str, Path]:
    found = {}
    for path in sorted((package / room).rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {t for t in out if t in known}


def unit_of(module: str, *, by_module: bool) -> str | None:
    parts = module.split(".")[2:]  # drop "nbaccel.<room>"
    if not parts:
        return None  # the room's __init__: its door, not a unit
    if by_module:
        return ".".join(parts)
    return parts[0]


def house(
    package: Path, *, by_module: bool, room: str = "runtime"
) -> tuple[int, int, list[set[str]]]:
    """(floors, arrows, cycles) of the room ``nbaccel/<room>`` under ``package``."""
    found = _modules(package, room)
    known = set(found)
    edges: dict[str, set[str]] = {}
    for name, path in found.items():
        src = unit_of(name, by_module=by_module)
        if src is None:
            continue
        edges.setdefault(src, set())
        for target in _imports(name, path, known):
            dst = unit_of(target, by_module=by_module)
            if dst is not None and dst != src and not dst.startswith(src + "."):
                edges[src].add(dst)
    arrows = sum(len(v) for v in edges.values())
    # fold strongly connected components (Tarjan), then the longest path in the DAG
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    comp: dict[str, int] = {}
    comps: list[set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w not in comp and w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while True:
                w = stack.pop()
                comp[w] = len(comps)
                members.add(w)
                if w == v:
                    break
            comps.append(members)

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    dag: dict[int, set[int]] = {i: set() for i in range(len(comps))}
    for v, ws in edges.items():
        dag[comp[v]].update(comp[w] for w in ws if comp[w] != comp[v])
    height: dict[int, int] = {}

    def floor(c: int) -> int:
        if c not in height:
            height[c] = 1 + max((floor(d) for d in dag[c]), default=0)
        return height[c]

    floors = max((floor(c) for c in dag), default=0)
    return floors, arrows, [c for c in comps if len(c) > 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", default=str(Path(__file__).parents[1] / "nbaccel"))
    parser.add_argument("--room", default="runtime", help="the folder of nbaccel to draw")
    parser.add_argument("--modules", action="store_true", help="count modules, not folders")
    args = parser.parse_args(argv)
    floors, arrows, cycles = house(Path(args.package), by_module=args.modules, room=args.room)
    unit = "modules" if args.modules else "folders"
    print(f"{args.package}/{args.room} ({unit}): {floors} floors, {arrows} arrows")
    for cycle in cycles:
        print("  cycle:", " <-> ".join(sorted(cycle)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
