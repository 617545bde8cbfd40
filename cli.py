"""`python cli.py ...` from a checkout: the `mlagen` command (mlagen/tools/cli.py) without installing it."""

from mlagen.tools.cli import app, main

__all__ = ["app", "main"]

if __name__ == "__main__":
    main()
