"""scripts/uv_env.py: uv gets the package sources pip is configured with (the set-ups install
with uv; uv reads no pip configuration, and this machine's names its local torch wheel)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "uv_env.py"
spec = importlib.util.spec_from_file_location("uv_env", SCRIPT)
assert spec is not None and spec.loader is not None
uv_env = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_env)

LISTED = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/elsewhere'
global.timeout='60'
"""


def test_pips_sources_reach_uv_the_environment_over_the_files():
    settings = uv_env.parse_config_list(LISTED)
    assert settings == {
        "cert": "/etc/ssl/certs/ca-certificates.crt",
        "find-links": "/opt/wheels",  # PIP_FIND_LINKS wins over pip.conf, as in pip
        "constraint": "/etc/xdg/pip/constraints.txt",
        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
    }
    lines = uv_env.uv_exports(settings, {})
    assert "export UV_FIND_LINKS=/opt/wheels" in lines
    assert "export UV_CONSTRAINT=/etc/xdg/pip/constraints.txt" in lines
    assert (
        "export UV_EXTRA_INDEX_URL='file:///opt/pypi/simple file:///opt/pypi-more/simple'" in lines
    )
    assert "export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" in lines
    assert "export UV_INDEX_STRATEGY=unsafe-best-match" in lines  # pip's best across indexes


def test_a_set_variable_wins_and_pips_dev_null_constraint_turns_the_cap_off():
    settings = uv_env.parse_config_list(LISTED + ":env:.constraint='/dev/null'\n")
    lines = uv_env.uv_exports(
        settings, {"UV_FIND_LINKS": "/mine", "UV_INDEX_STRATEGY": "first-index"}
    )
    assert not any(
        line.startswith(("export UV_CONSTRAINT", "export UV_FIND_LINKS")) for line in lines
    )
    assert not any("UV_INDEX_STRATEGY" in line for line in lines)


def test_the_imported_modules_of_the_venv_have_their_bytecode():
    # uv writes no .pyc unless told (scripts/uv_lib.sh tells it), and nbaccel's own modules
    # (an editable install) get theirs at the first import, unless PYTHONDONTWRITEBYTECODE is
    # set: then every kernel and worker of the run compiles them again (without both, the main
    # run took 2,102 CPU-s instead of 1,433, measured once): scripts/test.sh unsets it
    import sys

    import torch

    import nbaccel

    for module in (torch, nbaccel):
        cached = importlib.util.cache_from_source(str(module.__file__))
        assert Path(cached).is_file(), (
            f"{cached} missing: run the tests with PYTHONDONTWRITEBYTECODE unset "
            "(scripts/test.sh does)"
        )
    assert not sys.dont_write_bytecode
