"""quantkit's own cache of compiled C++ kernels: built by quantkit, loaded only after a digest check.

Inductor's C++ code cache (``torch._inductor.codecache``) compiles a source once and afterwards
loads whatever file sits under the source's hash name in ``TORCHINDUCTOR_CACHE_DIR`` (by default
``/tmp/torchinductor_$USER``, with no ownership check): a library planted there runs in the next
process that asks for the kernel. So quantkit keeps the compile step -- Inductor's ``CppBuilder``
with the flags ``CppPythonBindingsCodeCache`` uses, and its Python-binding wrapper -- and owns
where the output lives and how it is loaded:

* Directory: ``$QUANTKIT_CACHE_DIR/kernels/<torch version>/`` (default ``~/.cache/quantkit``).
  ``kernels/`` and the version folder are created with mode 0700 and refused when they are a
  symlink, owned by another user, or writable by group or others. Once checked, the folder is
  held open and every later step works through that descriptor, so renaming a folder above it
  afterwards changes nothing.
* Build: in a fresh ``tempfile.mkdtemp`` folder (0700), never in Inductor's cache (no
  precompiled header either: these sources do not include Inductor's prefix header). The
  library's SHA-256 is written to ``digests.json`` in the cache folder *before* the library is
  renamed into place, so a crash between the two leaves a record without a file (rebuilt next
  time), never a file without a record.
* Load: the file is opened without following links, read, hashed, and compared with the record;
  only then is that same open file (``/proc/self/fd/N``, the inode that was hashed) handed to the
  dynamic loader.

A library whose digest does not match its record, or that has no record, or a record that is not a
JSON object of hex digests, is **refused, not rebuilt**: only this user (or root) can write in a
0700 folder, so a mismatch there means something with this user's rights changed it, or the disk
damaged it; quietly compiling a fresh copy beside it would hide that, and nothing else in the folder
could be trusted either. The refusal is one line naming the file and the fix (delete the folder),
and callers fall back to another kernel saying why (``int4_cpu_status()``).

:func:`private_inductor_cache` gives Inductor's own code cache (the kernels ``torch.compile``
generates for a model's graph, which it loads without any digest) a folder with the same ownership
and permission checks, for the CLI to use when ``TORCHINDUCTOR_CACHE_DIR`` is not set.

Not covered: another process of the same user (or root) rewriting a library between the check and
the load; Inductor's generated kernels in a ``TORCHINDUCTOR_CACHE_DIR`` the user chose (checked by
nobody); the compiler and system headers themselves.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import stat
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = ["KernelLoadError", "KernelStatus", "cache_dir", "load", "load_with_status", "verify", "private_inductor_cache",
           "RECORD", "define_cpu_op"]

RECORD = "digests.json"  # {library file name: sha256 hex} of what quantkit built here
_LOCK = ".lock"
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # no link followed; a planted FIFO does not block the open
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,40}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_LOADED: dict[tuple[int, int, str], Callable] = {}  # (dev, ino of the cache folder, file name) -> entry function
_KEEP_OPEN: list[int] = []  # descriptors of loaded libraries: their /proc/self/fd/N names stay unique


class KernelLoadError(RuntimeError):
    """A kernel could not be built or was refused; the message is one line with the reason."""


@dataclass(frozen=True)
class KernelStatus:
    """Whether a compiled kernel runs here, and why not.

    Attributes:
        kernel: the op's name (``"quantkit::int4_linear_cpu"``).
        available: whether it runs on this machine.
        reason: one line: where it was loaded from, or why it cannot run.
        fault: the CPU could run it but the kernel was refused or failed to build (a cache folder
            or library that fails its checks, a compiler error): worth a warning, not just a note.
    """

    kernel: str
    available: bool
    reason: str
    fault: bool = False

    def __post_init__(self) -> None:
        if not self.kernel or not isinstance(self.reason, str) or "\n" in self.reason:
            raise ValueError(f"KernelStatus needs a kernel name and a one-line reason, got {self.kernel!r}, "
                             f"{self.reason!r}")

    def describe(self) -> str:
        """One line for reports: ``quantkit::int4_linear_cpu: available (...)`` or ``...: unavailable (why)``."""
        return f"{self.kernel}: {'available' if self.available else 'unavailable'} ({self.reason})"

    def to_dict(self) -> dict:
        return asdict(self)


def cache_dir() -> Path:
    """``$QUANTKIT_CACHE_DIR/kernels/<torch version>`` (default root ``~/.cache/quantkit``)."""
    root = os.environ.get("QUANTKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "quantkit")
    return Path(root) / "kernels" / re.sub(r"[^A-Za-z0-9._+-]", "_", torch.__version__)


def _check_dir(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise KernelLoadError(f"the kernel cache {path} is not a directory; remove it")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise KernelLoadError(f"the kernel cache {path} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
                              "remove it, or set QUANTKIT_CACHE_DIR to a directory of yours")
    if st.st_mode & 0o022:
        raise KernelLoadError(f"the kernel cache {path} is writable by group or others (mode "
                              f"{oct(stat.S_IMODE(st.st_mode))}); quantkit loads kernels only from a directory "
                              f"only you can write: chmod 700 {path}, or remove it")


def _open_private(parent_fd: int, name: str, path: Path, create: bool = True) -> int | None:
    """``parent/name``, created 0700 where absent (else None when absent and not ``create``), opened
    without following a link, and checked."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        raise KernelLoadError(f"the kernel cache {path} is a symlink or not a directory ({exc.strerror}); "
                              "remove it, or set QUANTKIT_CACHE_DIR to a directory of yours") from None
    try:
        _check_dir(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_cache(create: bool = True) -> int | None:
    """A descriptor of the checked cache folder (the caller closes it); None when it does not exist
    and ``create`` is False."""
    path = cache_dir()
    root = path.parent.parent
    try:
        if create:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        if create:
            raise KernelLoadError(f"cannot create the kernel cache under {root}; set QUANTKIT_CACHE_DIR to a "
                                  "writable directory") from None
        return None
    except OSError as exc:
        raise KernelLoadError(f"cannot create the kernel cache under {root} ({exc.strerror}); "
                              "set QUANTKIT_CACHE_DIR to a writable directory") from None
    try:
        mid = _open_private(root_fd, "kernels", path.parent, create)
    finally:
        os.close(root_fd)
    if mid is None:
        return None
    try:
        return _open_private(mid, path.name, path, create)
    finally:
        os.close(mid)


def private_inductor_cache() -> Path:
    """``$QUANTKIT_CACHE_DIR/inductor`` (default root ``~/.cache/quantkit``), created 0700 and checked
    like the kernel cache (not a link, yours, not group/other-writable): a folder for
    ``TORCHINDUCTOR_CACHE_DIR`` where the user has not set one. Inductor's default,
    ``/tmp/torchinductor_$USER``, is made by whoever comes first and never checked, and Inductor loads
    the libraries it finds there without a digest; in a private folder only this user can plant them.

    Raises:
        KernelLoadError: the folder is refused (one line with the reason).
    """
    path = cache_dir().parent.parent / "inductor"
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        root_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise KernelLoadError(f"cannot create {path} ({exc.strerror}); set QUANTKIT_CACHE_DIR to a writable "
                              "directory") from None
    try:
        os.close(_open_private(root_fd, path.name, path))
    finally:
        os.close(root_fd)
    return path


def _read_record(dfd: int, path: Path) -> dict[str, str]:
    """The digest record as ``{file: sha256}``; {} when absent. Refuses anything but that shape."""
    try:
        fd = os.open(RECORD, _READ, dir_fd=dfd)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise KernelLoadError(f"the kernel cache's digest record {path / RECORD} cannot be read ({exc.strerror}); "
                              f"delete {path} to rebuild the kernels") from None
    try:
        with os.fdopen(fd, "rb") as f:
            regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
            doc = json.loads(f.read(1 << 20).decode("utf-8")) if regular else None
    except (OSError, ValueError, RecursionError):  # unreadable, not JSON, or nested past the parser's depth
        doc = None
    if not (isinstance(doc, dict) and all(isinstance(k, str) and isinstance(v, str) and _HEX.match(v)
                                          for k, v in doc.items())):
        raise KernelLoadError(f"the kernel cache's digest record {path / RECORD} is not a JSON object of "
                              f"SHA-256 digests; not loading any kernel from it (delete {path} to rebuild them)")
    return doc


def _write_new(dfd: int, name: str, data: bytes, mode: int) -> None:
    """Write ``data`` to a name that must not exist yet (no link followed, nothing overwritten)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dfd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _replace(dfd: int, name: str, data: bytes, mode: int) -> None:
    """Atomically put ``data`` at ``name`` in the folder: a fresh temporary name, then a rename."""
    tmp = f".{name}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
    _write_new(dfd, tmp, data, mode)
    try:
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def _binding_source(argtypes: Sequence[str], source: str) -> str:
    """``source`` plus the Python binding Inductor generates for ``kernel(...)`` (``load_pybinding``)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as C

    parse = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {i})" for i, t in enumerate(argtypes))
    return source + C.suffix_template.format(arg_len=len(argtypes), call_entry_func=C.call_entry_function.format(parse),
                                             entry_func=C.entry_function, extra_parse_arg=C.extra_parse_arg.format(
                                                 array_len=-1))


def _options():
    """The build options ``CppPythonBindingsCodeCache`` compiles a binding with (no vectorisation
    headers: the sources say their own ISA with ``__attribute__((target(...)))``)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as C
    from torch._inductor.cpp_builder import CppTorchDeviceOptions

    return CppTorchDeviceOptions(**C.cpp_compile_command_flags, device_type="cpu", extra_flags=(),
                                 use_relative_path=False, compile_only=False, min_optimize=False)


def _cpu_identity() -> str:
    """The CPU the library is built for (the flags include ``-march=native``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f.read(1 << 16).splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(lines[:2])
    except OSError:
        import platform

        return platform.processor() or platform.machine()


def _build(name: str, code: str) -> bytes:
    """Compile ``code`` in a private temporary folder; the library's bytes."""
    from torch._inductor.cpp_builder import CppBuilder

    with tempfile.TemporaryDirectory(prefix="quantkit-build-") as tmp:
        src = os.path.join(tmp, f"{name}.cpp")
        with open(src, "w", encoding="utf-8") as f:
            f.write(code)
        builder = CppBuilder(name=name, sources=src, BuildOption=_options(), output_dir=tmp)
        try:
            builder.build()
        except Exception as exc:  # no compiler, or one without these intrinsics
            text = str(exc).splitlines()
            first = next((ln for ln in text if "error:" in ln), text[0] if text else type(exc).__name__)
            raise KernelLoadError(f"compiling quantkit's {name} kernel failed ({' '.join(first.split())[:200]}); "
                                  "check that a C++ compiler Inductor can use (g++ 9 or later) is installed") from None
        with open(builder.get_target_file_path(), "rb") as f:
            return f.read()


def _import(module_name: str, fd: int, path: Path) -> Callable:
    """Load the library open at ``fd`` as a Python extension; its ``kernel`` function."""
    # what Inductor's CppPythonBindingsCodeCache._load_library_inner sets before loading a binding
    # (torch 2.6+; earlier bindings do not read it)
    ptr = getattr(torch._C._dynamo.guards, "_torchinductor_pyobject_tensor_data_ptr", None)
    if ptr is not None:
        os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(ptr)
    origin = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
    loader = importlib.machinery.ExtensionFileLoader(module_name, origin)
    spec = importlib.util.spec_from_file_location(module_name, origin, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[module_name] = module
    return module.kernel


def _library(name: str, argtypes: Sequence[str], source: str) -> tuple[str, str, str]:
    """``(file name, module name, C++ with its binding)``: the name keys the source, the build
    command, torch and the CPU."""
    if not _NAME.match(name):
        raise ValueError(f"kernel name {name!r} must be lower-case letters, digits and underscores")
    from torch._inductor.cpp_builder import CppBuilder

    code = _binding_source(argtypes, source)
    command = CppBuilder(name="o", sources="i", BuildOption=_options()).get_command_line()
    key = hashlib.sha256("\0".join([code, command, torch.__version__, _cpu_identity()]).encode()).hexdigest()[:24]
    return f"{name}-{key}.so", f"quantkit_kernel_{name}_{key}.kernel", code


def _open_verified(dfd: int, file: str, record: dict[str, str], path: Path) -> int:
    """A descriptor of ``file``, opened without following a link, whose bytes match its record."""
    try:
        fd = os.open(file, _READ, dir_fd=dfd)
    except OSError as exc:
        raise KernelLoadError(f"{path / file} cannot be opened without following a link ({exc.strerror}); "
                              f"not loading it (delete {path} to rebuild the kernels)") from None
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            raise KernelLoadError(f"{path / file} is not a regular file; not loading it (delete {path} to "
                                  "rebuild the kernels)")
        if file not in record:
            raise KernelLoadError(f"{path / file} has no digest in {RECORD}: quantkit did not build it; not "
                                  f"loading it (delete {path} to rebuild the kernels)")
        if hashlib.sha256(os.pread(fd, fst.st_size + 1, 0)).hexdigest() != record[file]:
            raise KernelLoadError(f"{path / file} does not match the SHA-256 quantkit recorded when it built it; "
                                  f"not loading it (delete {path} to rebuild the kernels)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def verify(name: str, argtypes: Sequence[str], source: str) -> bool:
    """Whether the library :func:`load` would load is built and passes its checks, without building,
    loading or creating anything: True when it does, False when it is not built yet.

    Raises:
        KernelLoadError: as :func:`load` would, for a refused folder, record or library.
    """
    file, _, _ = _library(name, argtypes, source)
    path = cache_dir()
    dfd = _open_cache(create=False)
    if dfd is None:
        return False
    try:
        record = _read_record(dfd, path)
        try:
            os.stat(file, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        os.close(_open_verified(dfd, file, record, path))
        return True
    finally:
        os.close(dfd)


def load(name: str, argtypes: Sequence[str], source: str) -> Callable:
    """The C++ function ``kernel(...)`` of ``source``, built into (or verified and loaded from) the cache.

    Args:
        name: the kernel's name (lower case), the start of its file name.
        argtypes: C types of ``kernel``'s arguments (``"const float*"``, ``"int64_t"``), as
            ``CppPythonBindingsCodeCache.load_pybinding`` takes them; pointers receive tensors.
        source: C++ defining ``kernel``.

    Returns:
        A Python callable running ``kernel``.

    Raises:
        KernelLoadError: the cache folder is refused, the library fails its digest check, or the
            compiler fails; the message is one line with the reason and the fix.

    Example:
        >>> add_one = load("qk_example", ["int64_t*"], source)  # source: void kernel(int64_t* x) { x[0] += 1; }
        >>> add_one(torch.zeros(1, dtype=torch.int64))
    """
    file, module_name, code = _library(name, argtypes, source)
    path = cache_dir()
    dfd = _open_cache()
    try:
        st = os.fstat(dfd)
        if (st.st_dev, st.st_ino, file) in _LOADED:
            return _LOADED[(st.st_dev, st.st_ino, file)]
        with _locked(dfd):
            record = _read_record(dfd, path)
            try:
                os.stat(file, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                data = _build(name, code)
                record[file] = hashlib.sha256(data).hexdigest()
                _replace(dfd, RECORD, json.dumps(record, indent=1, sort_keys=True).encode(), 0o600)
                _replace(dfd, file, data, 0o500)
            fd = _open_verified(dfd, file, record, path)
        try:
            fn = _import(module_name, fd, path / file)
        except (ImportError, OSError, AttributeError) as exc:  # e.g. a missing libgomp, a noexec mount
            os.close(fd)
            text = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise KernelLoadError(f"{path / file} was verified but does not load ({text})") from None
        _KEEP_OPEN.append(fd)
        _LOADED[(st.st_dev, st.st_ino, file)] = fn
        return fn
    finally:
        os.close(dfd)


def load_with_status(kernel: str, loads: Callable[[], Any]) -> tuple[Any, KernelStatus]:
    """``(loads(), status)`` -- ``loads`` calls :func:`load` for one kernel or several -- or ``(None, status)``
    with the one-line reason it cannot run here: a :class:`KernelLoadError`'s message, or any other
    failure of Inductor's builder (another torch release's internals) as a reason, not a crash."""
    try:
        loaded = loads()
    except KernelLoadError as exc:
        return None, KernelStatus(kernel, False, str(exc), fault=True)
    except Exception as exc:  # noqa: BLE001
        text = " ".join(str(exc).split())[:200]
        return None, KernelStatus(kernel, False, f"building it failed ({type(exc).__name__}: {text})", fault=True)
    return loaded, KernelStatus(kernel, True, f"built and verified in {cache_dir()}")


# A plain torch.library registration, not @custom_op: its Python wrapper costs ~20 us more per call
# (measured: 45 vs 25 us on a tiny int4 layer), ~7% of a 4096x4096 M = 1 product.
def define_cpu_op(schema: str, impl: Callable, fake: Callable):
    """Define ``quantkit::<schema>`` with a CPU ``impl`` and a ``fake`` (shape) function, once per process:
    a kernel module can be imported twice, as ``quantkit.kernels._x`` and, with the source tree on
    ``sys.path``, as a top-level ``kernels._x`` (transformers probes for a ``kernels`` package). Returns
    the ``torch.library.Library`` to keep alive, or None when the op was already defined."""
    name = schema.split("(", 1)[0]
    if hasattr(torch.ops.quantkit, name):
        return None
    lib = torch.library.Library("quantkit", "FRAGMENT")
    lib.define(schema)
    lib.impl(name, impl, "CPU")
    torch.library.register_fake(f"quantkit::{name}", fake, lib=lib)
    return lib


@contextlib.contextmanager
def _locked(dfd: int):
    """An exclusive lock on the cache folder's lock file (two processes building at once)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the renames above are still atomic
        yield
        return
    fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
