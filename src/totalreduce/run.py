"""``python -m totalreduce.run -np N COMMAND...``: the same as ``totalrun``."""

from .launcher.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
