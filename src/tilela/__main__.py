"""``python -m tilela``: the ``tilela`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
