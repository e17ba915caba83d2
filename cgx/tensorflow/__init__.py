"""TensorFlow adapter: a drop-in for ``horovod.tensorflow`` with compressed gradient exchange.

Change ``import horovod.tensorflow as hvd`` to ``import cgx.tensorflow as hvd``::

    import cgx.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)

Keras users import ``cgx.tensorflow.keras`` (``DistributedOptimizer``,
callbacks). The adapter is thin: tensors cross to the torch-based core
through DLPack and every collective runs on the engine thread that
``cgx.torch`` shares (see ``docs/tensorflow.md``). Gradients travel quantized
(4 bits, bucket 1024 by default; see the ``CGX_*`` variables).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from cgx.errors import MissingDependencyError


def _load_triton_first() -> None:
    """Load Triton's native library before TensorFlow can break it.

    Loading ``triton._C.libtriton`` (it bundles LLVM) after TensorFlow crashes
    the process (segmentation fault, TF 2.21 / Triton 3.8 measured here), and
    torch loads Triton on its own, e.g. when a ``torch.optim`` optimizer is
    created. A process that uses TensorFlow and torch together therefore
    loads Triton first (~0.2 s); if TensorFlow is already loaded, Triton's
    library is bound to its own symbols (``RTLD_DEEPBIND``), which avoids the
    crash as well.
    """
    if "triton" in sys.modules or importlib.util.find_spec("triton") is None \
            or not hasattr(sys, "getdlopenflags"):
        return
    flags = sys.getdlopenflags()
    if "tensorflow" in sys.modules:
        sys.setdlopenflags(flags | getattr(os, "RTLD_DEEPBIND", 0))
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken Triton is torch's business, not this import's
        pass
    finally:
        sys.setdlopenflags(flags)


_load_triton_first()

try:
    import tensorflow as _tf  # noqa: F401
except ModuleNotFoundError as _exc:
    if _exc.name != "tensorflow":
        raise  # TensorFlow is there but broken: show its own error
    raise MissingDependencyError("tensorflow", "tensorflow",
                                 "cgx.tensorflow (the TensorFlow/Keras adapter)") from None

from cgx.runtime import (cross_rank, cross_size, is_initialized, local_rank, local_size, rank,
                         size)
from cgx.session import mpi_threads_supported
from cgx import session as _session
from cgx.capabilities import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                              is_homogeneous, mpi_built, mpi_enabled, nccl_built,
                              rocm_built)
from cgx.tensorflow.compression import Compression
from cgx.config import Config, Rounding
from cgx.tensorflow._bridge import XLAUnsupportedError
from cgx.tensorflow.gradients import DistributedGradientTape
from cgx.tensorflow.gradients import PartialDistributedGradientTape
from cgx.tensorflow import compat as _compat
from cgx.tensorflow.compat import (HorovodInternalError, SyncBatchNormalization, broadcast_,
                                   broadcast_global_variables, broadcast_object_fn,
                                   check_extension, gpu_available, grouped_allgather,
                                   grouped_reducescatter, join, local_rank_op, local_size_op,
                                   process_set_included_op, rank_op, reducescatter, size_op)
from cgx.tensorflow import elastic
from cgx.tensorflow.ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,
                                allgather, allgather_object, allreduce, alltoall, barrier,
                                broadcast, broadcast_object, broadcast_variables,
                                global_process_set, grouped_allreduce)
# One init/shutdown for both adapters: the same runtime, the same engine thread.
init = _session.init
add_process_set = _session.add_process_set
remove_process_set = _session.remove_process_set
shutdown = _session.shutdown
stats = _session.stats
start_timeline = _session.start_timeline
stop_timeline = _session.stop_timeline
# horovod.tensorflow's names for its util helpers (Horovod's scripts call hvd._executing_eagerly()).
_executing_eagerly, _make_subgraph, _cache = (_compat.executing_eagerly, _compat.make_subgraph,
                                              _compat.cache)



def _tf_distributed_optimizer(optimizer, name=None, use_locking=False, device_dense="",
                              device_sparse="", compression=Compression.none,
                              sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                              gradient_predivide_factor=1.0,
                              average_aggregated_gradients=False, num_groups=0, groups=None,
                              process_set=global_process_set, scale_local_gradients=True,
                              **kwargs):
    """``horovod.tensorflow.DistributedOptimizer``: the Keras ``DistributedOptimizer`` under
    ``horovod.tensorflow``'s signature (TF1 optimizers do not exist in TensorFlow 2.21;
    ``use_locking`` is accepted for compatibility)."""
    from cgx.tensorflow.keras import DistributedOptimizer
    return DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
        **kwargs)


_tf_distributed_optimizer.__name__ = "DistributedOptimizer"


def __getattr__(name):
    # horovod.tensorflow.DistributedOptimizer wraps Keras optimizers too; loading
    # Keras costs seconds, so only on first use.
    if name == "DistributedOptimizer":
        return _tf_distributed_optimizer
    raise AttributeError(f"module 'cgx.tensorflow' has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_threads_supported", "stats", "start_timeline",
    "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
    "rocm_built", "ddl_built", "ccl_built", "is_homogeneous",
    "stop_timeline", "HorovodInternalError", "PartialDistributedGradientTape",
    "SyncBatchNormalization", "add_process_set", "broadcast_", "broadcast_global_variables",
    "broadcast_object_fn", "check_extension", "elastic", "gpu_available", "grouped_allgather",
    "grouped_reducescatter", "join", "local_rank_op", "local_size_op",
    "process_set_included_op", "rank_op", "reducescatter", "remove_process_set", "size_op",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ProcessSet", "global_process_set",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "barrier",
    "broadcast_variables", "broadcast_object", "allgather_object",
    "Compression", "Config", "Rounding", "DistributedGradientTape", "DistributedOptimizer",
    "XLAUnsupportedError",
]
