"""Host-side tests of a hosted-notebook stack (scripts/stacks.env).

They drive something that runs inside a stack's Debian root (e.g. its Jupyter server)
from this machine (e.g. Debian's Chromium here), so they run only when
scripts/test_stacks.sh names the stack: ``NBACCEL_STACK`` (its name) and
``NBACCEL_STACK_ROOT`` (the root's folder). In the main run they are not collected.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("NBACCEL_STACK") else ["test_*.py"]
