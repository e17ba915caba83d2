"""What the GPU tests share: their marks, and ranks that share one GPU.

NCCL wants one GPU per rank, so on a one-GPU machine the tests' ranks run with
``CGX_BACKEND=gloo`` and ``cgx.init(device="cuda")``: gradients, kernels and streams are
the GPU's, and only the transport stages through host memory.
"""

from __future__ import annotations

import os

import pytest
import torch

# pytestmark of a GPU test module: marked ``gpu``, skipped (with the reason) without CUDA
NEEDS_CUDA = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def init_on(device: str, config=None):
    """``cgx.torch``, initialized in this rank on ``device`` over Gloo (``config``: a
    :class:`cgx.config.Config`, or None for the environment's)."""
    import cgx.torch as hvd
    os.environ["CGX_BACKEND"] = "gloo"
    hvd.init(config, device=device)
    return hvd


def mlp(device, hidden: int = 256):
    """A 32 -> hidden -> hidden -> 10 ReLU network, the same weights on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10)).to(device)
