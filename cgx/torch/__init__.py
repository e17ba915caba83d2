"""PyTorch adapter: a drop-in for ``horovod.torch`` with compressed gradient exchange.

Change ``import horovod.torch as hvd`` to ``import cgx.torch as hvd``; the
rest of a Horovod script stays as it is::

    import cgx.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

Gradients travel quantized (4 bits, bucket 1024 by default; see the
``CGX_*`` variables), reduced while backward runs. DDP users register
``cgx_hook`` instead (see ``cgx.torch.ddp``).
"""

from __future__ import annotations

from cgx.runtime import (cross_rank, cross_size, is_initialized, local_rank, local_size, rank,
                         size)
from cgx.session import mpi_threads_supported
from cgx.capabilities import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                              is_homogeneous, mpi_built, mpi_enabled, nccl_built,
                              rocm_built)
from cgx.compression import Compression
from cgx.config import Config, Rounding
from cgx import session as _session
from cgx.ops import Adasum, Average, Max, Min, Product, Sum
from cgx.process_sets import ProcessSet, global_process_set
from cgx.torch.ddp import CGXState, cgx_hook
from cgx.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                 broadcast_parameters)
from cgx.torch.ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                           allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                           broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                           grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                           grouped_allreduce_async, grouped_allreduce_async_,
                           grouped_reducescatter, grouped_reducescatter_async, join, poll,
                           reducescatter, reducescatter_async, sparse_allreduce_async,
                           synchronize)
from cgx.torch.compat import HorovodInternalError, check_extension, compression
from cgx.torch.optimizer import DistributedOptimizer
from cgx.torch.diloco import DiLoCo
from cgx.diloco import OuterSGD
from cgx.torch.sync_batch_norm import SyncBatchNorm
from cgx.torch.tensorboard import StatsLogger
from cgx.torch import elastic  # noqa: E402 - hvd.elastic (needs the names above)



init = _session.init
add_process_set = _session.add_process_set
remove_process_set = _session.remove_process_set
shutdown = _session.shutdown
stats = _session.stats
start_timeline = _session.start_timeline
stop_timeline = _session.stop_timeline


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_threads_supported", "stats", "start_timeline",
    "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
    "rocm_built", "ddl_built", "ccl_built", "is_homogeneous",
    "stop_timeline",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ProcessSet", "global_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "synchronize", "poll", "join", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "Compression", "Config", "Rounding", "DistributedOptimizer", "CGXState", "cgx_hook",
    "StatsLogger", "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async", "HorovodInternalError",
    "SyncBatchNorm", "add_process_set", "remove_process_set", "check_extension", "compression",
    "elastic", "DiLoCo", "OuterSGD",
]


def __getattr__(name):
    # cgx.torch.fsdp imports FSDP2 and DTensor (seconds): loaded on first use only.
    if name == "fsdp":
        import importlib
        return importlib.import_module("cgx.torch.fsdp")
    raise AttributeError(f"module 'cgx.torch' has no attribute {name!r}")
