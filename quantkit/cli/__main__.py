"""``python -m quantkit.cli ...``: the same as the ``quantkit`` command."""

import sys

from ._main import main

if __name__ == "__main__":
    sys.exit(main())
