"""setup.cfg's claims, scripts/stacks.env and the docs' tested matrix agree.

The hosted-notebook stacks (scripts/stacks.env) are what CI runs besides the dev venv and
the torch matrix: the Colab-like and Kaggle-like environments. This checks that what
setup.cfg accepts is what runs there (the ipywidgets floor is the Colab stack's 7.7.1), that
every test a stack runs exists, and that docs/reference/tested-matrix.md names each stack with
its versions.
"""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stacks_env() -> dict[str, str]:
    values = {}
    for line in (ROOT / "scripts" / "stacks.env").read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_]+)=(.*)", line.strip())
        if match:
            values[match.group(1)] = " ".join(shlex.split(match.group(2)))
    return values


def stack(name: str, field: str) -> str:
    return stacks_env()[f"STACK_{name}_{field}"]


def names() -> list[str]:
    return stacks_env()["STACKS"].split() + stacks_env()["EXTRA_STACKS"].split()


def setup_requirements(section: str, key: str) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return [r.strip() for r in cfg[section][key].splitlines() if r.strip()]


def test_the_colab_and_kaggle_stacks_are_defined() -> None:
    assert names() == ["colab", "kaggle", "py314"]
    assert stacks_env()["STACKS"].split() == ["colab", "kaggle"]  # what CI runs
    assert stack("colab", "PYTHON") == "python3.13" and stack("colab", "TORCH") == "2.11.0"
    assert "ipywidgets==7.7.1" in stack("colab", "PIP").split()
    assert (stack("kaggle", "TORCH"), stack("kaggle", "XLA")) == ("2.8.0", "2.8.0")


def test_setup_cfg_accepts_the_ipywidgets_colab_ships_and_8() -> None:
    notebook = setup_requirements("options.extras_require", "notebook")
    floor = next(r for r in notebook if r.startswith("ipywidgets"))
    assert floor == "ipywidgets>=7.7", floor  # Colab's 7.7.1 (colab stack) and 8 (.venv)
    colab = next(p for p in stack("colab", "PIP").split() if p.startswith("ipywidgets"))
    assert colab.split("==")[1].startswith(floor.split(">=")[1])


def test_every_test_a_stack_runs_exists() -> None:
    for name in names():
        for field in ("TESTS", "FULL_TESTS", "HOST_TESTS"):
            for test in stack(name, field).split():
                path = ROOT / test.split("::")[0]
                assert path.exists(), f"STACK_{name}_{field}: {test} does not exist"


def test_the_tested_matrix_page_lists_each_stack_with_its_versions() -> None:
    page = (ROOT / "docs" / "reference" / "tested-matrix.md").read_text()
    matrix = page[page.index("## Tested matrix") :]
    assert "Colab-like" in matrix and "Kaggle-like" in matrix
    for needle in ("Python 3.13", "torch 2.11.0", "ipywidgets 7.7.1", "ipykernel 6.17.1",
                   "torch_xla 2.8.0", "scripts/test_stacks.sh"):  # fmt: skip
        assert needle in matrix, needle
