"""Each file of tests/kernels in its own process when the kernels run in the Triton interpreter.

See tests/conftest.py: the interpreter has corrupted the shared test process in CI. A child
process per file keeps one file's damage from failing another's tests; a failing child shows its
own pytest output here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).resolve().parent / "kernels"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the compiled kernels are tested in this process")
@pytest.mark.parametrize("path", sorted(KERNELS.glob("test_*.py")), ids=lambda p: p.name)
def test_kernel_file_in_its_own_process(path):
    env = dict(os.environ, QUANTKIT_KERNEL_CHILD="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                          cwd=KERNELS.parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{path.name} failed in its own process:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout, proc.stdout[-2000:]  # the child really ran tests
