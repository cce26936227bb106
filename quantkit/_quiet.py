"""Keep third-party libraries' console output off quantkit's streams.

Importing torchao logs "Failed to load ..._C_*.so" for kernels built for other CUDA/Python
versions, and registering its enums makes torch's pytree warn. Neither matters to quantkit
(it uses only torchao's PT2E protocol classes), and both would land on the CLI's stderr, which
is reserved for errors. Levels are restored after the import.

:func:`silenced` does the same around a whole step that runs other libraries' code (the
compressed-tensors export loads the checkpoint back with transformers): their prints, log
records, warnings and progress bars go nowhere, unless ``QUANTKIT_DEBUG`` is set.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from typing import Iterator

__all__ = ["silenced"]

_NOISY = ("torchao", "torch.utils._pytree")
# libraries that log through loguru (compressed-tensors: to stdout with COMPRESSED_TENSORS_LOG_LEVEL)
_LOGURU_NAMES = ("compressed_tensors",)


def _import_torchao_quietly() -> None:
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
        import torchao.quantization.pt2e.quantizer  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _fds_to_devnull(fds: tuple[int, ...]) -> Iterator[None]:
    """Point the OS-level descriptors ``fds`` at /dev/null (C libraries print there directly,
    and logging handlers made earlier hold the original streams), restoring them after."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = []
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        devnull = None
    try:
        for fd in fds if devnull is not None else ():
            try:
                saved.append((fd, os.dup(fd)))
                os.dup2(devnull, fd)
            except OSError:
                continue
        yield
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, copy in reversed(saved):
            with contextlib.suppress(OSError):
                os.dup2(copy, fd)
            with contextlib.suppress(OSError):
                os.close(copy)
        if devnull is not None:
            with contextlib.suppress(OSError):
                os.close(devnull)


@contextlib.contextmanager
def _loguru_disabled(names: tuple[str, ...]) -> Iterator[None]:
    try:
        from loguru import logger
    except ImportError:
        yield
        return
    for name in names:
        logger.disable(name)
    try:
        yield
    finally:
        for name in names:
            logger.enable(name)


@contextlib.contextmanager
def silenced(*, fds: bool = True) -> Iterator[None]:
    """Discard what other libraries print, log or warn while the block runs.

    Covers ``print`` and ``sys.stdout``/``sys.stderr`` writes, ``logging`` records (whatever
    handler they have), ``warnings``, loguru (compressed-tensors) and, with ``fds``, what C code
    writes to file descriptors 1 and 2. Exceptions pass through untouched: the CLI prints them
    after the block. With ``QUANTKIT_DEBUG`` set nothing is discarded.

    Example:
        >>> with silenced():
        ...     model = transformers.AutoModel.from_pretrained(path)
    """
    if os.environ.get("QUANTKIT_DEBUG"):
        yield
        return
    sink = io.StringIO()
    previous = logging.root.manager.disable
    with contextlib.ExitStack() as stack:
        if fds:
            stack.enter_context(_fds_to_devnull((1, 2)))
        logging.disable(logging.CRITICAL)
        stack.callback(logging.disable, previous)
        stack.enter_context(_loguru_disabled(_LOGURU_NAMES))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        stack.enter_context(contextlib.redirect_stdout(sink))
        stack.enter_context(contextlib.redirect_stderr(sink))
        yield


_import_torchao_quietly()
