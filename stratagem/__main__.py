"""``python -m stratagem ...``: the same as the ``stratagem`` command."""

from stratagem.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
