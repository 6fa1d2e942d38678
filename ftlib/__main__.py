"""``python -m ftlib ...`` = the installed ``ftlib`` command (``ftlib.cli``)."""

import sys

from ftlib.cli import main

if __name__ == "__main__":
    sys.exit(main())
