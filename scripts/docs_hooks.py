"""MkDocs hooks: the pages of the documentation site that are generated from the code.

Two kinds of page are never written by hand, so they cannot drift from the code:

* ``reference/api/*.md``: one ``::: path`` block (mkdocstrings) per public name. The names
  are the ``__all__`` of the public modules (``nbaccel`` itself, whose names load lazily,
  ``nbaccel.errors``, ``nbaccel.config``, ``nbaccel.monitor``, ``nbaccel.widgets``); each
  is imported and documented at the module that defines it (``obj.__module__``), which
  mkdocstrings can read statically, under the public path users import it by. A module
  moved inside the package therefore needs no change here.
* ``reference/configuration.md``: every ``LaunchConfig`` field with its YAML key, its
  ``NBACCEL_*`` environment variable and its command-line flags, read from
  ``nbaccel.config`` (fields, help text, choices, defaults) and from the parser that
  ``nbaccel launch`` builds (``nbaccel.cli._options``).

And one kind of number on the written pages: ``%%house ROOM%%`` (``%%house ROOM modules%%``)
becomes "N floors, M arrows" of that folder of nbaccel as ``scripts/house.py`` counts it
when the site is built, so a page's count of the layout cannot drift from the code.

Example:
    >>> from docs_hooks import api_pages  # doctest: +SKIP
    >>> sorted(api_pages())  # doctest: +SKIP
    ['config', 'errors', 'launch', 'runtime', 'tracking', 'ui']
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
from typing import Any

#: the modules whose ``__all__`` is the public API, in the order a name is first documented
PUBLIC_MODULES = (
    "nbaccel",
    "nbaccel.errors",
    "nbaccel.config",
    "nbaccel.monitor",
    "nbaccel.widgets",
)

#: API page -> (title, introduction); a name goes to the page of the package defining it
PAGES = {
    "launch": ("Launching", "Start workers from a notebook cell, run jobs on them, debug them."),
    "runtime": ("Accelerator and runtime", "What runs inside the training function."),
    "config": ("Configuration", "The launch configuration and where its values come from."),
    "tracking": ("Tracking", "Trackers and progress bars."),
    "ui": ("Panel and monitor", "The ipywidgets panel and the live monitor."),
    "errors": ("Errors", "Every error nbaccel raises on purpose."),
}
#: defining package (``nbaccel.<package>``) -> API page
PACKAGE_PAGE = {
    "launch": "launch",
    "runtime": "runtime",
    "checkpoint": "runtime",
    "config": "config",
    "platform": "config",
    "tracking": "tracking",
    "ui": "ui",
    "widgets": "ui",
    "errors": "errors",
    "__init__": "launch",  # nbaccel.load_ipython_extension: the %%distributed magic
}


def _public_objects() -> dict[int, tuple[Any, list[str]]]:
    """``id(obj) -> (obj, public paths)`` for every documented class and function."""
    found: dict[int, tuple[Any, list[str]]] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # constants and type aliases: described on the pages that use them
            entry = found.setdefault(id(obj), (obj, []))
            entry[1].append(f"{module_name}.{name}")
    return found


def _page_of(obj: Any) -> str:
    parts = obj.__module__.split(".")
    package = parts[1] if len(parts) > 1 else "__init__"
    if package not in PACKAGE_PAGE:
        raise RuntimeError(
            f"{obj.__module__}.{obj.__qualname__} is public but defined in nbaccel.{package}, "
            "which no API page covers: add it to PACKAGE_PAGE in scripts/docs_hooks.py"
        )
    return PACKAGE_PAGE[package]


def _body(obj: Any) -> str:
    """mkdocstrings' block for ``obj``, or, for an object made at run time that is no
    attribute of its module (the refusing stand-ins of ``runtime.not_applicable``), its
    signature and docstring as they are."""
    module = importlib.import_module(obj.__module__)
    if vars(module).get(obj.__qualname__) is obj:  # not through a module __getattr__
        return (
            f"::: {obj.__module__}.{obj.__qualname__}\n"
            "    options:\n"
            "      show_root_heading: false\n"
            "      show_root_toc_entry: false\n"
            "      heading_level: 3\n"
        )
    try:
        signature = f"{obj.__name__}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        signature = obj.__name__
    return f"```python\n{signature}\n```\n\n{inspect.getdoc(obj) or ''}\n"


def api_pages() -> dict[str, str]:
    """The Markdown of each API page, ``{page: text}``, one section per public name."""
    sections: dict[str, list[tuple[str, str]]] = {page: [] for page in PAGES}
    for obj, paths in _public_objects().values():
        public, *aliases = paths
        also = f"\n\nAlso importable as {', '.join(f'`{a}`' for a in aliases)}." if aliases else ""
        text = f"## `{public}`{also}\n\n" + _body(obj)
        sections[_page_of(obj)].append((public.lower(), text))
    pages = {}
    for page, (title, intro) in PAGES.items():
        body = "\n".join(text for _, text in sorted(sections[page]))
        pages[page] = (
            f"# {title}\n\n{intro} Generated from the docstrings and signatures "
            "(scripts/docs_hooks.py).\n\n" + body
        )
    return pages


def _flags() -> dict[str, list[str]]:
    """``field -> command-line flags``, read from the parser ``nbaccel launch`` builds."""
    from nbaccel.cli._options import add_config_arguments

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags: dict[str, list[str]] = {}
    for action in parser._actions:
        flags.setdefault(action.dest, []).extend(action.option_strings)
    return flags


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def configuration_page() -> str:
    """The configuration keys, one row per ``LaunchConfig`` field."""
    from nbaccel.config import ENV_VARS, LaunchConfig, field_help, field_kind

    env = {field: var for var, field in ENV_VARS.items()}
    flags = _flags()
    helps = field_help()
    rows = []
    for f in dataclasses.fields(LaunchConfig):
        kind, choices = field_kind(f.name)
        shown = " / ".join(f"`{c}`" for c in choices) if choices else f"`{kind.__name__}`"
        names = ", ".join(f"`{flag}`" for flag in flags.get(f.name, []))
        rows.append(
            f"| `{f.name}` | `{env[f.name]}` | {names} | {shown} | `{f.default!r}` "
            f"| {_cell(helps.get(f.name, ''))} |"
        )
    return (
        "# Configuration keys\n\n"
        "Every launch setting is one field of `LaunchConfig` (`nbaccel.config`). The same name "
        "is the key in the YAML config file, the keyword of `notebook_launcher`, "
        "`start_workers` and `LaunchConfig(...)`, the `NBACCEL_*` environment variable and the "
        "flag of `nbaccel launch`. Precedence, highest first: an explicit argument, the "
        "environment variable, the config file, the default. This table is generated from the "
        "code when the site is built (scripts/docs_hooks.py); see "
        "[Configure a launch](../how-to/configure.md) for how to use it.\n\n"
        "| YAML key | environment | command line | type / choices | default | what it does |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        '`NBACCEL_USE_CPU=1` (and `--cpu`) is shorthand for `compute_device="cpu"`. The '
        "options of a launch that are not settings (rendezvous, output, `block`, ...) are "
        "`StartOptions` and `CallOptions`: see [the API](api/config.md).\n"
    )


def generated_pages() -> dict[str, str]:
    """Every generated page, ``{path under docs/: Markdown}``."""
    pages = {f"reference/api/{name}.md": text for name, text in api_pages().items()}
    pages["reference/configuration.md"] = configuration_page()
    return pages


_HOUSE = re.compile(r"%%house (\w+)( modules)?%%")


def house_counts(markdown: str) -> str:
    """``markdown`` with each ``%%house ROOM%%`` marker replaced by the room's counts.

    Example:
        >>> house_counts("launch/: %%house launch%%.")  # doctest: +SKIP
        'launch/: 6 floors, 32 arrows.'
    """
    from pathlib import Path

    from house import house

    package = Path(__file__).resolve().parents[1] / "nbaccel"

    def counts(match: re.Match[str]) -> str:
        floors, arrows, _ = house(package, by_module=bool(match[2]), room=match[1])
        return f"{floors} floors, {arrows} arrows"

    return _HOUSE.sub(counts, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs hook: the layout's counts, as the code has them now."""
    return house_counts(markdown)


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the site (never written to docs/)."""
    from mkdocs.structure.files import File

    for path, text in generated_pages().items():
        files.append(File.generated(config, path, content=text))
    return files


def _griffe_extension() -> type:
    import griffe

    class ExampleSections(griffe.Extension):
        """Read nbaccel's ``Example:`` sections as Google style's ``Examples:``.

        griffe's Google parser knows only the plural; the singular, this codebase's habit,
        would be an admonition of raw Markdown, where ``>>>`` is a quote and an output
        such as ``[[4, 5]]`` a link.
        """

        def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
            if obj.docstring is not None:
                obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)

    return ExampleSections


_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.M)


def __getattr__(name: str) -> Any:
    # mkdocstrings loads the extension as "scripts/docs_hooks.py:ExampleSections"; griffe
    # is imported only then (the module stays importable without the docs extra)
    if name == "ExampleSections":
        return _griffe_extension()
    raise AttributeError(name)
