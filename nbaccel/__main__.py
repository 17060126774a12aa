"""``python -m nbaccel``: the same as the ``nbaccel`` command."""

from .cli import main

raise SystemExit(main())
