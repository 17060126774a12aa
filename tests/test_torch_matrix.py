"""The torch that setup.cfg claims is the torch CI tests, and the docs' tested matrix says so."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _matrix() -> list[str]:
    text = (ROOT / "scripts" / "torch_matrix.env").read_text()
    match = re.search(r"^TORCH_MATRIX=(.+)$", text, re.M)
    assert match, "scripts/torch_matrix.env must set TORCH_MATRIX"
    return shlex.split(match.group(1))[0].split()


def _torch_floor() -> tuple[int, int]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    for req in cfg["options"]["install_requires"].split("\n"):
        match = re.fullmatch(r"\s*torch\s*>=\s*(\d+)\.(\d+)(?:\.\d+)?\s*", req)
        if match:
            return int(match.group(1)), int(match.group(2))
    raise AssertionError("setup.cfg must require torch>=X.Y")


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_the_oldest_matrix_torch_is_the_claimed_floor():
    versions = _matrix()
    assert len(versions) >= 2, "the matrix is the oldest claimed torch and the newest release"
    assert versions == sorted(versions, key=lambda v: tuple(int(p) for p in v.split(".")))
    assert _major_minor(versions[0]) == _torch_floor()


def test_the_tested_matrix_page_states_the_claim_and_every_matrix_torch():
    # the README's "Tested matrix" section moved to this page of the documentation site
    page = (ROOT / "docs" / "reference" / "tested-matrix.md").read_text()
    section = page.split("## Tested matrix", 1)[-1]
    major, minor = _torch_floor()
    assert f"`torch>={major}.{minor}`" in section
    for version in _matrix():
        assert f"torch {version}" in section, version


def _root_conftest(pytestconfig):
    # `from conftest import ...` may find another folder's conftest (tests/stacks/) first
    path = str(ROOT / "tests" / "conftest.py")
    return next(
        p for p in pytestconfig.pluginmanager.get_plugins() if getattr(p, "__file__", "") == path
    )


def test_every_matrix_module_exists_in_the_matrix_folders(pytestconfig):
    # a module renamed or moved would silently drop out of the matrix
    MATRIX_MODULES = _root_conftest(pytestconfig).MATRIX_MODULES

    text = (ROOT / "scripts" / "torch_matrix.env").read_text()
    match = re.search(r'^TORCH_MATRIX_TESTS="(.+)"$', text, re.M)
    assert match, "scripts/torch_matrix.env must set TORCH_MATRIX_TESTS"
    folders = match.group(1).split()
    for module in MATRIX_MODULES:
        assert (ROOT / module).is_file(), f"{module} (conftest.MATRIX_MODULES) does not exist"
        assert any(module.startswith(f"{folder}/") for folder in folders), (module, folders)
