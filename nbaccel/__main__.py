"""``python -m nbaccel``: the same as the ``nbaccel`` command."""

from .cli import main

if __name__ == "__main__":  # importing the module (a documentation tool does) runs nothing
    raise SystemExit(main())
