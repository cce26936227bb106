"""Low-level file-system guards shared by the writers (``export/_atomic``, ``sequential/_state``).

``O_NOFOLLOW``/``O_CLOEXEC`` where the platform has them, and an exclusive ``flock`` on a
directory: the kernel drops it when its holder dies, so a lock that can be taken means that
nobody is writing there, whatever a recorded pid names now.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; callers fall back to what they know without it
    fcntl = None

__all__ = ["NOFOLLOW", "CLOEXEC", "HAS_FLOCK", "lock_dir", "unlock"]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
HAS_FLOCK = fcntl is not None


def lock_dir(path: str | os.PathLike) -> int | None:
    """An open descriptor of directory ``path`` (not followed if a link) holding an exclusive
    flock, or None where the platform has no flock.

    Raises:
        BlockingIOError: another descriptor holds the lock.
        OSError: ``path`` is not a directory we can open (or is a link).
    """
    if fcntl is None:
        return None
    fd = os.open(Path(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlock(fd: int | None) -> None:
    """Drop a lock taken by :func:`lock_dir` (closing the descriptor drops the flock)."""
    if fd is not None:
        os.close(fd)
