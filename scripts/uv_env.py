"""Print the `export UV_...` lines that give uv the package sources pip is configured with.

The set-up scripts install with uv (`uv pip install`: the same requirements, resolved the
same way, at a tenth of pip's CPU time: scripts/uv_lib.sh), but uv reads no pip
configuration, and a machine's may matter: here pip.conf names a folder of local wheels
(`find-links`, where the CPU build of torch lies), local indexes (`extra-index-url`), a
constraints file that caps torch, and a CA bundle. This reads pip's own view of them
(`pip config list`: the files and the PIP_* environment) and prints them for uv; an UV_*
variable already set wins.

Example:
    $ python3 scripts/uv_env.py
    export UV_FIND_LINKS='/opt/wheels'
    export UV_INDEX_STRATEGY='unsafe-best-match'
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

# pip's key -> uv's variable (each takes a space-separated list, as pip's do)
_KEYS = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "cert": "SSL_CERT_FILE",
}
# pip reads these sections; a later one wins (pip: the environment over the files, a
# command's own section over `global`)
_ORDER = ("global", "install", ":env:")


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective value of each key in `_KEYS`, from ``python -m pip config list``."""
    listed = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    return parse_config_list(listed)


def parse_config_list(listed: str) -> dict[str, str]:
    """The effective values in ``pip config list``'s output (``section.key='value'`` lines)."""
    found: dict[str, dict[str, str]] = {}
    for line in listed.splitlines():
        match = re.match(r"^(:env:|[\w-]+)\.([\w-]+)='(.*)'$", line.strip())
        if match and match.group(2) in _KEYS:
            found.setdefault(match.group(2), {})[match.group(1)] = match.group(3)
    return {
        key: next(v for section in reversed(_ORDER) if (v := values.get(section)) is not None)
        for key, values in found.items()
        if any(section in values for section in _ORDER)
    }


def uv_exports(settings: dict[str, str], environ: dict[str, str]) -> list[str]:
    """The export lines: one per setting, none for a variable the caller set."""
    lines = []
    for key, value in settings.items():
        name = _KEYS[key]
        if name in environ:
            continue
        if key == "constraint":  # pip's PIP_CONSTRAINT=/dev/null turns its cap off
            value = " ".join(path for path in value.split() if path != "/dev/null")
        if value:
            lines.append(f"export {name}={shlex.quote(value)}")
    # pip takes the best version across every index; uv's default stops at the first index
    # that has the package (a local index holding an old release would win)
    if "UV_INDEX_STRATEGY" not in environ:
        lines.append("export UV_INDEX_STRATEGY=unsafe-best-match")
    return lines


def main(argv: list[str]) -> int:
    python = argv[0] if argv else sys.executable
    print("\n".join(uv_exports(pip_settings(python), dict(os.environ))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
