"""Horovod's "what is built / enabled" queries, answered for cgx.

Scripts and test suites written for Horovod branch on these first thing
(``if hvd.nccl_built(): ...``). cgx has no build flags of its own: it runs on
existing engines, so "built" means "the engine is importable here" and
"enabled" means "this job's transport uses it".
"""

from __future__ import annotations

import importlib.util


def _transport_name() -> str:
    from cgx import runtime
    return runtime.transport().name if runtime.is_initialized() else ""


def mpi_built() -> bool:
    """True when MPI collectives can be used (mpi4py is installed)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True when this job's transport is MPI (``CGX_TRANSPORT=mpi``)."""
    return _transport_name() == "mpi"


def gloo_built() -> bool:
    """True when torch.distributed's Gloo backend is available."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """True when this job reduces over Gloo (torch.distributed, or Horovod's Gloo mode)."""
    return _transport_name() in ("torch-gloo", "horovod")


def nccl_built() -> bool:
    """True when torch.distributed's NCCL backend is available (a CUDA build of torch)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_nccl_available()


def cuda_built() -> bool:
    """True for a CUDA build of torch."""
    import torch
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """True for a ROCm build of torch."""
    import torch
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """IBM DDL: never used by cgx."""
    return False


def ccl_built() -> bool:
    """Intel oneCCL: never used by cgx."""
    return False


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    from cgx import runtime
    w = runtime.world()
    return w.size == w.local_size * w.cross_size


__all__ = ["mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
           "rocm_built", "ddl_built", "ccl_built", "is_homogeneous"]
