"""Write a directory beside its final place and swap it in, so the final path is never half-written or missing.

Temporary directories are named ``.NAME.quantkit-tmp-<pid>-lk<random>`` (the new contents)
and ``.NAME.quantkit-old-<pid>-lk<random>`` (the previous contents while they are being
replaced, on systems without an atomic exchange). The writer holds an exclusive ``flock``
on each while it works; the kernel drops it when the writer dies, however it dies. A writer
killed outright (SIGKILL, power loss) leaves them behind; the next write beside the same
path removes those nobody holds, and puts back an ``-old-`` backup if the final path is
missing. The pid in the name is not trusted alone: a killed writer's pid may be a zombie
not yet reaped, or recycled (in a container the next run often gets the same pid).
Directories in the older unlocked form (``-<pid>-<random>``) are removed once their pid is
dead, and so are ``-new-`` ones (a directory made, not yet locked and renamed). The
temporary directory is created with mode 0700 (nobody else can plant files in it
while it is written) and gets the umask's ordinary mode just before it is swapped in.

On Linux the new directory and the old one swap places in one ``renameat2(RENAME_EXCHANGE)``
call; elsewhere (or on file systems without it) the old directory is renamed aside, the new
one renamed in, and the old one restored if that fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

from .._errors import QuantkitError
from .._fsutil import HAS_FLOCK, lock_dir, unlock

__all__ = ["atomic_dir", "recover", "existing_entries", "Terminated", "sigterm_as_interrupt", "exchange"]

_LEFTOVER = re.compile(r"\.(?P<name>.+)\.quantkit-(?P<kind>tmp|old|new)-(?P<pid>[0-9]+)-(?P<lk>lk)?[0-9a-f]+\Z")
_AT_FDCWD = -100  # <fcntl.h>
_RENAME_EXCHANGE = 2  # <linux/fs.h>: 1 << 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that ``finally``/cleanup code runs."""


@contextlib.contextmanager
def sigterm_as_interrupt(*, redeliver: bool = True) -> Iterator[None]:
    """Within: SIGTERM raises :class:`Terminated` instead of killing the process at once.

    Only where SIGTERM still has its default action and this is the main thread (a
    handler the program installed is left alone). With ``redeliver``, a block that ends
    in ``Terminated`` then terminates the process with SIGTERM, as the signal would have,
    once cleanup has run; the CLI passes ``redeliver=False`` and exits with 143 itself.
    """
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    received = []

    def handler(signum, frame):
        received.append(signum)
        raise Terminated("terminated by SIGTERM")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if redeliver and received:
            signal.raise_signal(signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends (a rename pair or a cleanup must not be cut in half)."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # on Windows os.kill(pid, 0) would terminate pid
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    try:  # a zombie (killed, not yet reaped by its parent) answers kill(pid, 0) but writes nothing
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[:1] not in ([b"Z"], [b"X"])
    except OSError:
        return True


def _writer_gone(path: Path, pid: int, locked_form: bool) -> bool:
    """Whether the writer of the temporary directory ``path`` is gone: its flock is free (a
    dead writer holds none, whatever its pid now names), or, for the unlocked form, its pid is dead."""
    if not _pid_alive(pid):
        return True
    if not locked_form or not HAS_FLOCK:
        return False
    try:
        unlock(lock_dir(path))
    except BlockingIOError:
        return False  # held: a writer is at work
    except OSError:
        return False
    return True


def _leftovers(path: Path) -> list[tuple[str, Path]]:
    """(kind, dir) of temporary directories beside ``path`` whose writer is no longer running."""
    out = []
    prefix = f".{path.name}.quantkit-"
    try:
        entries = [e for e in os.scandir(path.parent) if e.name.startswith(prefix)]
    except OSError:
        return out
    for entry in entries:
        m = _LEFTOVER.match(entry.name)
        if m and m["name"] == path.name and entry.is_dir(follow_symlinks=False) \
                and _writer_gone(Path(entry.path), int(m["pid"]), bool(m["lk"])):
            out.append((m["kind"], Path(entry.path)))
    return out


def recover(path: str | os.PathLike) -> None:
    """Clean up after writers of ``path`` that died: put back the newest backup of the old
    directory if ``path`` is missing, and remove the rest of their temporary directories."""
    path = Path(path).absolute()
    leftovers = _leftovers(path)
    backups = sorted((d for kind, d in leftovers if kind == "old"), key=lambda d: d.stat().st_mtime, reverse=True)
    with _signals_deferred():
        if backups and not os.path.lexists(path):
            os.rename(backups[0], path)
            leftovers = [(k, d) for k, d in leftovers if d != backups[0]]
        for _, d in leftovers:
            shutil.rmtree(d, ignore_errors=True)


def existing_entries(path: str | os.PathLike, *, overwrite: bool, flag: str = "overwrite=True",
                     exists_error: type[QuantkitError] = QuantkitError) -> list[str]:
    """The entries (sorted names) of the output directory ``path`` that a write would replace: ``[]`` when
    it is absent or empty. First cleans up after a killed writer of ``path`` (:func:`recover`); the
    caller checks that the entries are its own.

    Raises:
        QuantkitError: ``path`` is a file or a link; ``exists_error``: it exists and ``overwrite`` is
            False (the message names ``flag``, the way to replace it).
    """
    path = Path(path)
    recover(path)
    if not (path.exists() or path.is_symlink()):
        return []
    if not path.is_dir() or path.is_symlink():
        raise QuantkitError(f"output {str(path)!r} exists and is not a directory; choose another output path")
    if not overwrite:
        raise exists_error(f"output directory {str(path)!r} already exists; pass {flag} to replace it")
    return sorted(os.listdir(path))


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False where the platform or file system cannot."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _new_name(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.quantkit-{kind}-{os.getpid()}-lk{secrets.token_hex(4)}"


def _replace(tmp: Path, path: Path) -> None:
    """Put ``tmp`` at ``path``; the previous ``path`` (if any) is kept until then, restored on failure."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
        return
    if exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # now the old contents
        return
    old = _new_name(path, "old")
    held = lock_dir(path)  # before it takes the -old- name: never seen there unheld while we live
    try:
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        unlock(held)


def _fsync(path: Path, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync directories
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath), directory=True)


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _make_tmp(path: Path) -> tuple[Path, int | None]:
    """A new temporary directory beside ``path`` (mode 0700), locked before anyone else can see it
    unheld: it is made and locked under a ``-new-`` name (which recover() leaves alone while
    our pid lives), then renamed to its ``-tmp-`` name."""
    tmp = _new_name(path, "tmp")
    staging = path.parent / f".{path.name}.quantkit-new-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(staging, 0o700)
    try:
        held = lock_dir(staging)
    except BaseException:
        os.rmdir(staging)
        raise
    try:
        os.rename(staging, tmp)
    except BaseException:
        unlock(held)
        os.rmdir(staging)
        raise
    return tmp, held


def _check_tmp(tmp: Path, path: Path) -> None:
    """The temporary directory is still a directory (no link) beside ``path``, where we made it."""
    st = os.lstat(tmp)
    if not stat.S_ISDIR(st.st_mode) or os.path.realpath(tmp.parent) != os.path.realpath(path.parent):
        raise OSError(errno.EXDEV, f"the temporary directory {str(tmp)!r} was replaced while it was written")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, before_commit: Callable[[Path], None] | None = None,
               check: Callable[[], object] | None = None) -> Iterator[Path]:
    """Yield a fresh directory beside ``path``; when the block succeeds it replaces ``path``.

    ``before_commit(tmp)`` runs on the finished directory, ``check()`` right before the swap
    (e.g. to refuse a ``path`` that appeared meanwhile). On any error, Ctrl-C or SIGTERM the
    temporary directory and the parent directories this created are removed and ``path`` is
    left as it was; the swap itself cannot be interrupted by either signal.
    """
    path = Path(path).absolute()
    with sigterm_as_interrupt():
        recover(path)
        created = []
        parent = path.parent
        while not parent.exists():
            created.append(parent)
            parent = parent.parent
        for p in reversed(created):
            p.mkdir(exist_ok=True)
        tmp, held = _make_tmp(path)
        try:
            yield tmp
            if before_commit is not None:
                before_commit(tmp)
            _fsync_tree(tmp)
            with _signals_deferred():
                if check is not None:
                    check()
                _check_tmp(tmp, path)
                os.chmod(tmp, 0o777 & ~_umask())
                _replace(tmp, path)
        except BaseException:
            with _signals_deferred():
                shutil.rmtree(tmp, ignore_errors=True)
                for p in created:
                    with contextlib.suppress(OSError):
                        p.rmdir()
            raise
        finally:
            unlock(held)
        _fsync(path.parent, directory=True)
