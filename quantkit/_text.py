"""Text that reaches a terminal: the one filter every printed field goes through.

Strings the CLI prints come from files it did not write (``report.json``, ``quantization.json``,
config files, path names) and from exceptions. A terminal acts on control characters in them:
ESC and the 8-bit CSI/OSC/ST (U+009B, U+009D, U+009C) move the cursor, clear the screen or set
the window title; bidirectional overrides (U+202E, ...) show text in another order than it has.
:func:`printable` shows each such character as a visible escape instead.
"""

from __future__ import annotations

import re

__all__ = ["printable", "strip_ansi", "summarise", "UNPRINTABLE"]

# C0 controls (tab, newline, carriage return included), DEL, the C1 controls U+0080-U+009F,
# the bidirectional marks, embeddings, overrides and isolates of Unicode UAX #9 (U+061C,
# U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), the line and paragraph separators (U+2028,
# U+2029: a line break to some terminals) and lone surrogates (which cannot be encoded at all)
_OTHERS = "\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff"
UNPRINTABLE = re.compile(f"[\x00-\x1f{_OTHERS}]")
_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_OTHERS}]")
# ANSI sequences (CSI ... final byte, and two-byte ESC sequences): formatting of a library's message
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: object, *, newlines: bool = False) -> str:
    """``str(text)`` with every control character and bidirectional override shown as an escape.

    Characters :data:`UNPRINTABLE` matches become ``\\x9c``-style escapes (``\\u202e`` above U+00FF);
    everything else, printable non-ASCII text included, is kept. The result holds only
    printable characters (and newlines, with ``newlines=True``), so applying it twice changes
    nothing.

    Args:
        text: the field to print (anything: ``str()`` of it is filtered).
        newlines: keep ``\\n`` (a block of lines, e.g. a table); tabs and ``\\r`` are escaped anyway.

    Example:
        >>> printable("mlp\\x9d0;title\\x9c \\u202eevil")
        'mlp\\\\x9d0;title\\\\x9c \\\\u202eevil'
    """
    return (_BUT_NEWLINE if newlines else UNPRINTABLE).sub(_escape, str(text))


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (the colours of a library's error message).

    Only complete sequences are removed; pass the result through :func:`printable` before
    printing it, which shows any other control character.
    """
    return _ANSI.sub("", text)


def summarise(exc: BaseException, limit: int = 240) -> str:
    """``"TypeName: first line"`` of an exception, the line cut to ``limit`` characters (with ``...``):
    the one-line form of a library's long message (torch.export prints whole graphs)."""
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    if len(first) > limit:
        first = first[:limit - 3] + "..."
    return f"{type(exc).__name__}: {first}"
