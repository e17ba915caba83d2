"""Shared pytest set-up of the cgx test suite.

Triton kernels need a CUDA device. Without one, the tests run them under
Triton's CPU interpreter (slow: ~ms per program, so Triton tests use small
inputs). Triton decides between compiling and interpreting when a kernel is
*decorated*, i.e. when ``cgx.kernels.quantize`` is first imported, reading
``TRITON_INTERPRET`` then; conftest.py is imported before any test module, so
setting the variable here is early enough. An explicit TRITON_INTERPRET in the
environment wins.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
