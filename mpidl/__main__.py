"""``python -m mpidl COMMAND ...``: the same as the ``mpidl`` console script."""
import sys

from mpidl.cli import main

if __name__ == "__main__":
    sys.exit(main())
