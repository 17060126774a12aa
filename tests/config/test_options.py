"""Every launch option is defined once, in nbaccel.config, and every face takes it from there.

notebook_launcher, start_workers and WorkerPool.call (their parameters, ``**options``
TypedDicts, defaults and help), the CLI's flags and the panel's controls must agree with
the one definition: LaunchConfig's fields (settings: ``None`` = not given) and
StartOptions/CallOptions. No process is started here.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re
import textwrap
import typing

import pytest
import typing_extensions

from nbaccel import notebook_launcher, start_workers
from nbaccel.cli import build_parser
from nbaccel.config import LaunchConfig, field_kind, field_names
from nbaccel.config.options import CALL, START, CallOptions, StartOptions
from nbaccel.errors import ConfigError
from nbaccel.launch.pool import WorkerPool

LAUNCH = pathlib.Path(notebook_launcher.__code__.co_filename).parent
CONFIG_HINTS = typing.get_type_hints(LaunchConfig)
DEFINED = {
    cls: (typing.get_type_hints(cls), {f.name: f.default for f in dataclasses.fields(cls)})
    for cls in (StartOptions, CallOptions)
}
OWN = ("function", "args", "kwargs", "self")


def _options(function) -> dict[str, tuple[object, object]]:
    """``{option: (type, default)}`` of a launch function: its parameters and the keys of
    its ``**options`` TypedDict (as written: ``__annotations__``); the defaults are those
    ``inspect.signature`` (help(), IDEs) shows."""
    hints = typing.get_type_hints(function, localns={"Unpack": typing_extensions.Unpack})
    shown = inspect.signature(function).parameters
    out = {}
    for name in function.__annotations__:
        if name in (*OWN, "return"):
            continue
        if typing.get_origin(hints[name]) is typing_extensions.Unpack:  # **options
            (keywords,) = typing.get_args(hints[name])
            out.update(
                {k: (t, shown[k].default) for k, t in typing.get_type_hints(keywords).items()}
            )
        else:
            out[name] = (hints[name], shown[name].default)
    return out


def default_shown(name: str) -> object:
    """The default help() names: an option's own, a setting's LaunchConfig field's."""
    for _, defaults in DEFINED.values():
        if name in defaults:
            return defaults[name]
    return getattr(LaunchConfig(), name)


def _check_against_the_definition(name: str, hint: object, default: object) -> None:
    for cls, (types, defaults) in DEFINED.items():
        if name in defaults:
            assert hint == types[name], (name, cls.__name__)
            assert default == defaults[name], (name, cls.__name__)
            return
    assert name in CONFIG_HINTS, f"{name} is defined nowhere in nbaccel.config"
    assert hint == CONFIG_HINTS[name] | None, name  # a setting: the field's type, or None
    assert default is None, name  # None: not given (the field's default is its own)


@pytest.mark.parametrize("function", [notebook_launcher, start_workers, WorkerPool.call])
def test_each_parameter_is_its_definition_with_its_default_and_help(function):
    options = _options(function)
    for name, (hint, default) in options.items():
        _check_against_the_definition(name, hint, default)
    shown = inspect.signature(function).parameters  # what help() and IDEs show
    assert [n for n in shown if n not in OWN] == list(options)
    doc = " ".join((inspect.getdoc(function) or "").split())
    for name in options:  # each option has its help in the docstring, with its default
        entry = re.search(rf" {name}: (.+?) \(default: (.+?)\)", doc)
        assert entry and entry[2] == repr(default_shown(name)), name


def test_the_functions_take_the_options_they_should():
    launcher = set(_options(notebook_launcher))
    call_fields = {f.name for f in dataclasses.fields(CallOptions)}
    assert launcher >= {f.name for f in dataclasses.fields(StartOptions)} | call_fields
    # a pool: the launcher's, less one call's, restarts and the debug wait of one launch
    pool = launcher - call_fields - {"max_restarts", "replace_timeout", "debug_timeout"}
    assert set(_options(start_workers)) == pool
    assert set(_options(WorkerPool.call)) == call_fields | {"hang_after", "on_hang"}
    # the defaults are read from the definition, not written again
    assert inspect.signature(notebook_launcher).parameters["block"].default is CALL.block
    assert inspect.signature(start_workers).parameters["rdzv_id"].default is START.rdzv_id


def test_the_cli_and_the_panel_take_every_setting_and_its_choices():
    launch = build_parser()._subparsers._group_actions[0].choices["launch"]
    actions = {a.option_strings[0][2:]: a for a in launch._actions if a.option_strings}
    widgets = pytest.importorskip("nbaccel.ui._panel_parts")
    for name in field_names():
        _, choices = field_kind(name)
        assert actions[name].default is None  # not given: the file and environment decide
        if choices:
            assert tuple(actions[name].choices) == choices == typing.get_args(CONFIG_HINTS[name])
            control = widgets.make_control(name, getattr(LaunchConfig(), name))
            assert tuple(control.options) == choices


def _literals(node: ast.AST) -> list[str]:
    return [e.value for e in getattr(node, "elts", []) if isinstance(e, ast.Constant)]


def _copies(node: ast.AST, names: set[str]) -> list[str]:
    """Option names ``node`` writes again: as strings (a list, a dict's keys, one string
    of names) or as values passed on under their own name (``dict(k=k)``, ``f(k=k, ...)``,
    ``{"k": k}``); empty when it names fewer than ``_MANY`` of them that way."""
    words: list[object] = _literals(node)
    if isinstance(node, ast.Dict):
        words = [k.value for k in node.keys if isinstance(k, ast.Constant)]
        words += [  # {"k": k}: a value passed on under its own name counts twice
            k.value
            for k, v in zip(node.keys, node.values, strict=True)
            if isinstance(k, ast.Constant) and isinstance(v, ast.Name) and v.id == k.value
        ]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        words = node.value.split()  # "num_processes mixed_precision ...".split()
    if isinstance(node, ast.Call):  # dict(k=k, ...), f(k=k, ...)
        same = [
            k.arg for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id == k.arg
        ]
        listed = [w for w in same if w in names]
        return listed if len(listed) >= _MANY else []
    listed = [w for w in words if w in names]
    return listed if len(set(listed)) >= 2 and len(listed) > len(words) / 2 else []


#: more options than one call forwards on purpose (debug_launcher passes two on)
_MANY = 3


def _pass_ons(tree: ast.AST) -> set[int]:
    """``id`` of each call that passes a function's own parameters on by name
    (``dict(num_nodes=num_nodes, ...)`` in ``notebook_launcher``): the signature's names
    flowing to their use, which a reader can follow, not the option set written again
    (that each parameter is passed on is checked by the test below)."""
    found = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        params = {a.arg for a in (*fn.args.args, *fn.args.kwonlyargs)}
        for node in ast.walk(fn):
            same = [
                k.arg
                for k in getattr(node, "keywords", [])
                if isinstance(k.value, ast.Name) and k.value.id == k.arg
            ]
            if isinstance(node, ast.Call) and same and set(same) <= params:
                found.add(id(node))
    return found


def test_launch_lists_no_option_names_and_passes_no_locals():
    names = set(field_names()) | {f.name for c in DEFINED for f in dataclasses.fields(c)}
    found = []
    for path in sorted(LAUNCH.rglob("*.py")):  # the doors and every folder
        text = path.read_text()
        # no locals(): each option goes from its parameter to its use by name
        assert "locals()" not in text, path
        assert not re.search(r"^(DEFAULT_HANG_AFTER|DEBUG_TIMEOUT)\s*=\s*[\d.]", text, re.M)
        tree = ast.parse(text)
        passed_on = _pass_ons(tree)
        for node in ast.walk(tree):
            if id(node) not in passed_on and (listed := _copies(node, names)):
                found.append(f"{path.name}:{node.lineno}: {listed}")
    assert not found, "option names written again in launch/:\n" + "\n".join(found)
    assert start_workers.__annotations__["options"] == "Unpack[PoolKeywords]"  # not Any


@pytest.mark.parametrize("function", [notebook_launcher, start_workers, WorkerPool.call])
def test_each_parameter_reaches_its_use(function):
    # Every option of a door is read in its body (passed on by name, e.g. notebook_launcher's
    # dict(num_nodes=num_nodes, ...) to split()): a parameter added to the signature and
    # never passed on would be accepted and silently ignored.
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    params = [a.arg for a in (*fn.args.args, *fn.args.kwonlyargs) if a.arg != "self"]
    if fn.args.kwarg is not None:
        params.append(fn.args.kwarg.arg)  # **options
    read = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert [p for p in params if p not in read] == [], function.__qualname__


def test_a_pass_on_is_only_of_the_function_own_parameters():
    # the guard above still sees a copy: names listed in a function that does not take them
    copy = "def f(a):\n    return dict(num_processes=num_processes, use_port=use_port, a=a)\n"
    assert not _pass_ons(ast.parse(copy))
    own = "def f(num_processes, use_port, a):\n    return dict(num_processes=num_processes, use_port=use_port, a=a)\n"
    assert _pass_ons(ast.parse(own))


@pytest.mark.parametrize(
    "source",
    [
        "x = dict(num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port)",
        "f(a, num_processes=num_processes, master_addr=master_addr, node_rank=node_rank)",
        'x = {"num_processes": num_processes, "use_port": use_port}',
        'x = ["num_processes", "mixed_precision"]',
        'x = "num_processes mixed_precision use_port".split()',
    ],
)
def test_the_copy_finder_sees_every_form_of_copy(source):
    # the guard above can fail: each way the launch parameters were (or could be) copied
    names = set(field_names()) | {f.name for c in DEFINED for f in dataclasses.fields(c)}
    assert any(_copies(node, names) for node in ast.walk(ast.parse(source))), source


@pytest.mark.parametrize(
    ("call", "error", "needle"),
    [
        (lambda: notebook_launcher(print, monitor_interval=0), ConfigError, "monitor_interval=0"),
        (lambda: notebook_launcher(print, use_port="abc"), TypeError, "use_port='abc'"),
        (lambda: notebook_launcher(print, block="no"), TypeError, "block='no' must be True"),
        (lambda: notebook_launcher(print, output=5), TypeError, "output=5 must be a file-like"),
        (lambda: notebook_launcher(print, on_hang="explode"), ConfigError, "on_hang='explode'"),
        (lambda: notebook_launcher(print, timeout="5"), TypeError, "timeout='5' must be a number"),
        (lambda: notebook_launcher(print, num_gpus=2), TypeError, "takes no num_gpus"),
        (lambda: start_workers(2, block=False), TypeError, "block: it is an option of each pool"),
        (lambda: start_workers(2, debug_timeout=5), TypeError, "takes no debug_timeout"),
    ],
)
def test_bad_options_name_the_argument_before_anything_starts(call, error, needle):
    with pytest.raises(error, match=re.escape(needle)):
        call()
