"""``python -m quantkit ...``: the same as the ``quantkit`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
