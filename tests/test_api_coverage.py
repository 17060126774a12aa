"""docs/api-coverage.md stays true: every row of the table is checked against nbaccel.

The table lists every public name of Accelerate's documented API with one status:

* ``same`` -- nbaccel has it at the path the porting rule gives (``accelerate`` -> ``nbaccel``)
  and, for a callable, accepts every parameter Accelerate documents by keyword, with the
  required ones in the same positions (docs/api-scan/accelerate-signatures.json records
  Accelerate's signatures, so this test does not need Accelerate installed);
* ``differs`` -- nbaccel has it and the row says how and why (a difference a script cannot
  trip over silently);
* ``n/a`` -- calling it raises the error the row names: ``call: `EXPR` → `Error`: "text"``
  (``EXPR`` is evaluated with ``nbaccel``, ``utils`` = nbaccel.utils, ``acc`` = an
  ``Accelerator(cpu=True)`` and ``torch`` in scope); never an AttributeError;
* ``gap`` -- not there yet (docs/api-scan and the issue tracker say who builds it): the test
  fails as soon as it resolves, so that the row is updated.

Also: every name the scan of public scripts found (docs/api-scan/usage.json) resolves in nbaccel
or is in the table as n/a or gap.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "api-coverage.md"
SIGNATURES = ROOT / "docs" / "api-scan" / "accelerate-signatures.json"
USAGE = ROOT / "docs" / "api-scan" / "usage.json"
STATUSES = ("same", "differs", "n/a", "gap")
_ROW = re.compile(r"^\|\s*`(?P<name>[^`]+)`\s*\|\s*(?P<status>[^|]+?)\s*\|(?P<notes>.*)\|\s*$")
_CALL = re.compile(r'call: `(?P<expr>[^`]+)` → `(?P<exc>\w+)`(?:: "(?P<msg>[^"]+)")?')


def table_rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        m = _ROW.match(line)
        if m and m["status"] != "status":
            rows.append((m["name"], m["status"], m["notes"].strip()))
    return rows


@cache
def accelerate_signatures() -> dict[str, Any]:
    return json.loads(SIGNATURES.read_text())["names"]


@cache
def instances() -> dict[str, Any]:
    import nbaccel
    from nbaccel.logging import get_logger

    accelerator = nbaccel.Accelerator(cpu=True)
    local_sgd = importlib.import_module("nbaccel.local_sgd").LocalSGD if _has("local_sgd") else None
    return {
        "Accelerator": accelerator,
        "AcceleratorState": accelerator.state,
        "PartialState": nbaccel.PartialState(),
        "GradientState": getattr(accelerator, "gradient_state", None),
        "MultiProcessAdapter": get_logger("api-coverage"),
        "LocalSGD": local_sgd,
    }


def _has(module: str) -> bool:
    try:
        importlib.import_module(f"nbaccel.{module}")
    except ImportError:
        return False
    return True


_MISSING = object()


def resolve(name: str) -> Any:
    """nbaccel's object for an Accelerate name (``_MISSING`` when there is none)."""
    name = name.rstrip("=")
    head, _, attr = name.partition(".")
    if head != "accelerate":
        owner = instances().get(head)
        if owner is None:
            return _MISSING
        return getattr(owner, attr, _MISSING)
    parts = ["nbaccel", *name.split(".")[1:]]
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def signature_problem(acc_params: list[list] | None, obj: Any) -> str | None:
    """Why a script calling ``obj`` as Accelerate documents it would fail (None: it would not)."""
    if acc_params is None or not callable(obj):
        return None
    if [kind for _, kind, _ in acc_params] == ["VAR_POSITIONAL", "VAR_KEYWORD"]:
        return None  # a decorator's wrapper: Accelerate's real parameters are not recorded
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].name == "self":  # a class's constructor, or a method read off a class
        params = params[1:]
    by_name = {p.name: p for p in params}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    acc_names = {name for name, _, _ in acc_params}
    for index, (name, kind, has_default) in enumerate(acc_params):
        if kind == "VAR_POSITIONAL":
            if not any(p.kind is p.VAR_POSITIONAL for p in params):
                return f"does not take *{name}"
            continue
        if kind == "VAR_KEYWORD":
            continue
        p = by_name.get(name)
        if p is None and not var_kw:
            return f"parameter {name!r} is not accepted"
        if p is not None and p.kind is p.POSITIONAL_ONLY and kind != "POSITIONAL_ONLY":
            return f"parameter {name!r} is positional-only"
        required = kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD") and not has_default
        if required and (index >= len(positional) or positional[index].name != name):
            return f"required parameter {name!r} is not at position {index}"
    for p in params:
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if required and p.name not in acc_names:
            return f"requires {p.name!r}, which Accelerate does not have"
    return None


def accepts_keyword(obj: Any, kw: str) -> bool:
    """Whether ``obj(..., kw=...)`` is accepted by the signature."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return True  # a builtin: cannot tell
    if kw in params:
        return params[kw].kind is not inspect.Parameter.POSITIONAL_ONLY
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_row(name: str, status: str, notes: str) -> str | None:
    """None when the row is true, else what is wrong with it."""
    if status not in STATUSES:
        return f"unknown status {status!r} (one of {STATUSES})"
    if status == "n/a":
        return _check_not_applicable(notes)
    obj = resolve(name)
    setter = name.endswith("=")
    if status == "gap":
        if obj is not _MISSING and not (setter and not _assignable(name)):
            problem = signature_problem(accelerate_signatures().get(name, {}).get("params"), obj)
            if problem is None:
                return "resolves in nbaccel now: set its status (same/differs) and notes"
        return None
    if obj is _MISSING:
        return "does not resolve in nbaccel"
    if setter and not _assignable(name):
        return "cannot be assigned"
    if status == "differs":
        return None if notes else "a 'differs' row must say how and why"
    return signature_problem(accelerate_signatures().get(name, {}).get("params"), obj)


def _assignable(name: str) -> bool:
    head, _, attr = name.rstrip("=").partition(".")
    owner = instances().get(head)
    prop = inspect.getattr_static(type(owner), attr, None)
    return not (isinstance(prop, property) and prop.fset is None)


def _check_not_applicable(notes: str) -> str | None:
    m = _CALL.search(notes)
    if m is None:
        return 'an n/a row needs: call: `EXPR` → `ErrorType`: "message text"'
    import torch

    import nbaccel
    import nbaccel.data_loader
    import nbaccel.utils

    namespace = {"nbaccel": nbaccel, "utils": nbaccel.utils, "torch": torch}
    namespace["acc"] = instances()["Accelerator"]
    try:
        eval(m["expr"], namespace)
    except Exception as exc:
        names = [c.__name__ for c in type(exc).__mro__]
        if isinstance(exc, AttributeError):
            return f"raises AttributeError ({exc}); n/a must raise a clear error instead"
        if m["exc"] not in names:
            return f"raises {type(exc).__name__}: {exc} (the row says {m['exc']})"
        if m["msg"] and m["msg"] not in str(exc):
            return f"message {str(exc)!r} does not contain {m['msg']!r}"
        return None
    return f"`{m['expr']}` raised nothing"


ROWS = table_rows()


@pytest.fixture(autouse=True, scope="module")
def _forget_the_accelerator():
    """Later tests launch processes from this one: leave no Accelerator state behind."""
    yield
    instances.cache_clear()
    from nbaccel.runtime.process.state import reset_state

    reset_state()


def test_the_table_lists_every_documented_name():
    listed = {name for name, _, _ in ROWS}
    missing = sorted(set(accelerate_signatures()) - listed)
    assert not missing, f"names of Accelerate's documented API missing from {TABLE.name}: {missing}"
    dup = sorted({n for n in listed if sum(1 for r in ROWS if r[0] == n) > 1})
    assert not dup, f"listed twice: {dup}"


@pytest.mark.parametrize(("name", "status", "notes"), ROWS, ids=[r[0] for r in ROWS])
def test_row_is_true(name, status, notes):
    problem = check_row(name, status, notes)
    assert problem is None, f"{name} ({status}): {problem}"


def test_every_name_public_scripts_use_resolves_or_is_listed():
    listed = {name: status for name, status, _ in ROWS}
    usage = json.loads(USAGE.read_text())["keys"]
    unexplained = []
    for key, info in usage.items():
        name = key.split("(")[0]
        if key.startswith("accelerate.test_utils.") or listed.get(name) in ("n/a", "gap"):
            continue
        obj = resolve(name)
        if obj is _MISSING or (name.endswith("=") and not _assignable(name)):
            unexplained.append(f"{key} ({info['count']} files)")
            continue
        if "(" in key and not accepts_keyword(obj, key.split("(")[1].rstrip("=)")):
            unexplained.append(f"{key} ({info['count']} files)")
    assert not unexplained, (
        "used by public scripts, missing in nbaccel and not in the table:\n"
        + "\n".join(unexplained)
    )


def test_the_porting_rule_is_stated_one_way():
    """``import accelerate`` ports to ``from nbaccel import accelerate`` (whose ``__version__``
    is Accelerate's API version, so version gates take Accelerate's path); ``import nbaccel as
    accelerate`` would silently give nbaccel's own version to those gates."""
    wrong = "import nbaccel as accelerate"
    places = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "notebooks").glob("*")]
    places += [*(ROOT / "nbaccel").rglob("*.py"), *(ROOT / "tests" / "scripts").rglob("*")]
    stating = [p for p in places if p.is_file() and wrong in p.read_text(errors="replace")]
    assert not stating, (
        f"{wrong!r} is stated in {stating}; the rule is 'from nbaccel import accelerate'"
    )
    assert "`import accelerate` → **`from nbaccel import accelerate`**" in (
        (ROOT / "docs" / "tutorials" / "porting.md").read_text()
    )
