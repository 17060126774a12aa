"""The documentation site builds strict, holds what it promises, and can be searched.

One strict build per module (``bash scripts/docs.sh build`` into a temporary folder, the command
a reader runs) is shared by every test here: that it passed; that each public name has its API
entry and each configuration key its row with its environment variable and flag (both
generated from the code); that the example notebooks are shown with their outputs and that
their executed copies are the notebooks of ``notebooks/`` (a stale copy fails); that the search
index holds ``on_hang``. A browser test opens the built site in Debian's Chromium, searches for
``on_hang`` and lands on its page. A copy of the docs with one broken link (and one with a
broken anchor) must fail the strict build, while the same copy without it passes.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import docs_hooks  # noqa: E402
import docs_notebooks  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # one strict build of the whole site: 25-35 s on 2 loaded cores
    pytest.mark.skipif(shutil.which("bash") is None, reason="scripts/docs.sh needs bash"),
]


def _build(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "docs.sh"), "build", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,  # stops a stuck build; a loaded machine is slow
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = _build(["--site-dir", str(out)])
    assert proc.returncode == 0, f"the strict docs build failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _html(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text(encoding="utf-8")


def test_the_strict_build_passes_and_every_nav_page_is_built(site: Path) -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True

    def pages(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [p for v in nav.values() for p in pages(v)]
        assert isinstance(nav, list)
        return [p for v in nav for p in pages(v)]

    for page in pages(config["nav"]):
        stem = re.sub(r"(/?index)?\.(md|ipynb)$", "", page)
        assert (site / stem / "index.html").is_file(), page


def test_every_public_name_has_its_api_entry(site: Path) -> None:
    pages = {page: _html(site, f"reference/api/{page}") for page in docs_hooks.PAGES}
    for obj, paths in docs_hooks._public_objects().values():
        text = pages[docs_hooks._page_of(obj)]
        assert f"<code>{paths[0]}</code>" in text, paths[0]


def test_the_api_shows_signatures_and_raised_errors(site: Path) -> None:
    launch = _html(site, "reference/api/launch")
    assert "on_hang" in launch and "num_processes" in launch  # notebook_launcher's options
    runtime = _html(site, "reference/api/runtime")
    assert "Raises" in runtime  # Google style "Raises:" sections are rendered as such


def test_every_configuration_key_has_its_names(site: Path) -> None:
    import dataclasses

    from nbaccel.config import ENV_VARS, LaunchConfig

    text = _html(site, "reference/configuration")
    env = {field: var for var, field in ENV_VARS.items()}
    for f in dataclasses.fields(LaunchConfig):
        row = re.search(rf"<tr>\s*<td><code>{f.name}</code></td>(.*?)</tr>", text, flags=re.S)
        assert row, f.name
        assert f"<code>{env[f.name]}</code>" in row.group(1), f.name
        assert f"<code>--{f.name}</code>" in row.group(1), f.name


def _code(path: Path) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def test_the_executed_notebooks_are_the_examples_with_outputs() -> None:
    sources = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    copies = sorted(p.name for p in (ROOT / "docs" / "notebooks").glob("*.ipynb"))
    assert copies == sources
    for name in sources:
        copy = ROOT / "docs" / "notebooks" / name
        assert _code(copy) == _code(ROOT / "notebooks" / name), (
            f"docs/notebooks/{name} is stale: re-make it with `bash scripts/docs.sh notebooks {name}`"
        )
        outputs = [o for c in nbformat.read(copy, as_version=4).cells for o in c.get("outputs", [])]
        assert outputs, f"docs/notebooks/{name} has no outputs"
        assert not [o for o in outputs if o.output_type == "error"], name
    assert set(docs_notebooks.AS_COMMITTED) <= set(sources)


def test_the_notebooks_are_shown_with_their_outputs(site: Path) -> None:
    from test_notebooks import EXPECTED  # the claim each notebook prints

    for name, (_, claim) in EXPECTED.items():
        page = _html(site, f"notebooks/{name.removesuffix('.ipynb')}")
        text = html.unescape(re.sub(r"<[^>]+>", "", page))
        assert re.search(claim, text), f"{name}: {claim!r} is not on its page"


def test_the_search_index_holds_an_option(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text())
    where = {doc["location"].split("#")[0] for doc in index["docs"] if "on_hang" in doc["text"]}
    assert "reference/notebook-launcher/" in where, sorted(where)


# ----------------------------------------------------------------- a broken link fails it
def _light_copy(tmp_path: Path) -> Path:
    """The docs and mkdocs.yml, with the same strict validation and the generated pages, but
    without rendering API blocks and notebooks (the slow part; not what is tested here)."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")  # notebooks: static files, links hold
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["plugins"] = ["search"]
    del config["hooks"]  # the generated pages are written as files instead, once
    for path, text in docs_hooks.generated_pages().items():
        (tmp_path / "docs" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / path).write_text(text)
    config["nav"] = _without_notebooks(config["nav"])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return tmp_path


def _without_notebooks(nav: object) -> object:
    if isinstance(nav, list):
        kept = [_without_notebooks(v) for v in nav]
        return [v for v in kept if v not in (None, [], {})]
    if isinstance(nav, dict):
        return {k: v for k, v in ((k, _without_notebooks(v)) for k, v in nav.items()) if v}
    return None if str(nav).endswith(".ipynb") else nav


def _light_build(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "mkdocs", "build", "--strict",
         "-f", str(root / "mkdocs.yml"), "--site-dir", str(root / "site")],
        cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path: Path) -> None:
    root = _light_copy(tmp_path)
    page = root / "docs" / "how-to" / "cli.md"
    page.write_text(
        page.read_text()
        + "\nSee [the options](no-such-page.md) and [the panel](panel.md#no-such-anchor).\n"
    )
    broken = _light_build(root)
    assert broken.returncode != 0, broken.stderr
    # exactly the two breaks are reported: the copy builds without them
    warnings = [line for line in broken.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 2, broken.stderr
    assert "no-such-page.md" in warnings[0] + warnings[1], broken.stderr
    assert "no-such-anchor" in warnings[0] + warnings[1], broken.stderr


# ------------------------------------------------------------------------- the browser
@pytest.mark.browser
def test_search_in_a_browser_lands_on_the_page(site: Path, tmp_path: Path) -> None:
    import importlib.util

    from browser_scenario import CHROMIUM, LONG, open_chromium

    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: run `bash scripts/setup_browser.sh` (Debian chromium)")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed: run `bash scripts/setup_browser.sh`")
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:  # a free port for the static server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
         "--directory", str(site)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with sync_playwright() as pw:
            context, page = open_chromium(pw, tmp_path / "profile", height=900)
            try:
                for _ in range(600):  # the server is up when the page loads
                    try:
                        page.goto(f"http://127.0.0.1:{port}/", timeout=LONG)
                        break
                    except Exception:
                        page.wait_for_timeout(100)
                page.locator(".md-search__input").first.click()
                # typed key by key, as a reader does (the search listens to keyboard input)
                page.locator("input.md-search__input").press_sequentially("on_hang", delay=20)
                hit = page.locator(".md-search-result__item a", has_text="on_hang").first
                hit.wait_for(timeout=LONG)
                hit.click()
                page.wait_for_url(re.compile(r".*/reference/.*"), timeout=LONG)
                assert "on_hang" in page.locator("article").inner_text()
            finally:
                context.close()
    finally:
        server.terminate()
        server.wait(timeout=60)
