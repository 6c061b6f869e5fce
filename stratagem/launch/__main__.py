"""``python -m stratagem.launch ...``: the same as ``stratagem launch ...``."""

from stratagem.launch.command import main

if __name__ == "__main__":
    raise SystemExit(main())
