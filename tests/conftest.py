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


def pytest_configure(config):
    """With QUANTKIT_TEST_INSTALLED=1 (CI), refuse to test anything but an installed, non-editable quantkit."""
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


def pytest_collection_modifyitems(session, config, items):
    """The Triton-interpreter kernel tests run first (as they did before tests/accuracy sorted ahead
    of them): after Inductor had compiled in the same process, the interpreted kernels' ops failed
    with std::bad_alloc / vector::reserve in the CI run (not reproducible with those files alone)."""
    items.sort(key=lambda item: 0 if "/tests/kernels/" in str(item.path).replace(os.sep, "/") else 1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
