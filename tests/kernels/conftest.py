"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

``triton.jit`` picks interpreter or compiler when the kernel is decorated, i.e. when
``quantkit.kernels`` is first imported, so the variable is set here, at collection, before any
test module imports it. With CUDA present the real kernels run instead (GPU tests).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
