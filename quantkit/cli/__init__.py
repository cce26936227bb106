"""The ``quantkit`` command line: argument parsing and error reporting (``_main``), the
``quantize`` / ``eval`` / ``inspect`` commands, and their data, input and report helpers.

``main`` is the console-script entry point (``quantkit = "quantkit.cli:main"``).
"""

from ._main import main

__all__ = ["main"]
