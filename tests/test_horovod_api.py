"""The public surface of horovod.torch, horovod.tensorflow and horovod.tensorflow.keras 0.28.1
against cgx's: every name exists, each refusal says what to use instead, and the new pieces
(grouped and sparse collectives, reduce-scatter gradients, TF graph-mode helpers) behave as
Horovod defines them.

HOROVOD_API lists Horovod 0.28.1's public names (its modules' internals, such as ``mpi_ops``
or ``tf``, left out). Where Horovod is built (``make test`` builds it), the list is checked
against the installed package, so it stays true.
"""

import os
import re

import pytest
import torch

from spawn import run_gloo

HOROVOD_API = {
    "horovod.torch": [
        "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
        "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather",
        "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
        "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
        "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
        "broadcast_parameters", "ccl_built", "check_extension", "compression", "cross_rank",
        "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built",
        "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
        "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
        "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_initialized", "join",
        "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
        "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set",
        "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
        "stop_timeline", "synchronize",
    ],
    "horovod.tensorflow": [
        "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
        "Max", "Min", "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum",
        "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object", "allreduce",
        "alltoall", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
        "broadcast_object_fn", "broadcast_variables", "ccl_built", "check_extension",
        "compression", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
        "global_process_set", "gloo_built", "gloo_enabled", "gpu_available", "grouped_allgather",
        "grouped_allreduce", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized",
        "join", "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built",
        "mpi_enabled", "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank",
        "rank_op", "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size",
        "size_op", "start_timeline", "stop_timeline",
    ],
    "horovod.tensorflow.keras": [
        "Average", "Compression", "DistributedOptimizer", "ProcessSet", "Sum", "add_process_set",
        "allgather", "allreduce", "broadcast", "broadcast_global_variables", "callbacks",
        "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
        "global_process_set", "gloo_built", "gloo_enabled", "init", "is_initialized", "load_model",
        "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
        "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built", "shutdown",
        "size", "start_timeline", "stop_timeline",
    ],
    "horovod.tensorflow.keras.callbacks": [
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
        "LearningRateWarmupCallback", "MetricAverageCallback",
    ],
}
# Each module's hvd.elastic: Horovod's __all__ (ObjectState, State and the exceptions are
# reached there too).
ELASTIC_API = {
    "horovod.torch": ["ElasticSampler", "TorchState", "run"],
    "horovod.tensorflow": ["TensorFlowKerasState", "TensorFlowState", "run"],
    "horovod.tensorflow.keras": ["CommitStateCallback", "KerasState", "UpdateBatchStateCallback",
                                 "UpdateEpochStateCallback", "run"],
}
# Names Horovod's modules expose that are its own internals, not API.
HOROVOD_INTERNALS = {
    "mpi_lib_v2", "mpi_ops", "sync_batch_norm", "LocalGradientAggregationHelper",
    "check_num_rank_power_of_2", "functions", "gradient_aggregation",
    "handle_average_backwards_compatibility", "refs_to_vars", "split_list", "tf", "util",
    "vars_to_refs", "version", "warnings", "K", "inspect", "is_version_greater_equal_than",
    "keras", "optimizer", "os", "gradient_aggregation_eager",
}
# What cgx refuses, with a message that names what to use instead.
REFUSED = {
    "horovod.torch": [],
    "horovod.tensorflow": ["SyncBatchNormalization", "broadcast_global_variables", "join"],
    "horovod.tensorflow.keras": ["broadcast_global_variables"],
}
CGX = {"horovod.torch": "cgx.torch", "horovod.tensorflow": "cgx.tensorflow",
       "horovod.tensorflow.keras": "cgx.tensorflow.keras",
       "horovod.tensorflow.keras.callbacks": "cgx.tensorflow.keras.callbacks"}
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "horovod.md")


def _cgx(module):
    import importlib
    if "tensorflow" in module:
        pytest.importorskip("cgx.tensorflow", exc_type=ImportError)
    return importlib.import_module(CGX[module])


@pytest.mark.parametrize("module", sorted(HOROVOD_API))
def test_every_horovod_name_exists(module):
    mod = _cgx(module)
    missing = [n for n in HOROVOD_API[module] if not hasattr(mod, n)]
    assert not missing, f"{CGX[module]} lacks Horovod's {missing}"


@pytest.mark.parametrize("module", sorted(ELASTIC_API))
def test_hvd_elastic_has_horovods_names(module):
    elastic = _cgx(module).elastic
    names = ELASTIC_API[module] + ["ObjectState", "State", "HostsUpdatedInterrupt"]
    missing = [n for n in names if not hasattr(elastic, n)]
    assert not missing, f"{CGX[module]}.elastic lacks Horovod's {missing}"
    try:
        import importlib
        theirs = importlib.import_module(module + ".elastic")
    except ImportError:
        return  # the names above are Horovod 0.28.1's, checked where it is built
    assert sorted(theirs.__all__) == ELASTIC_API[module]


@pytest.mark.parametrize("module", sorted(HOROVOD_API))
def test_the_list_is_horovods(module):
    try:
        import importlib
        hvd = importlib.import_module(module)
    except ImportError:
        pytest.skip("Horovod is not built here (make test builds it)")
    live = sorted(n for n in dir(hvd) if not n.startswith("_") and n not in HOROVOD_INTERNALS)
    assert live == sorted(HOROVOD_API[module])


@pytest.mark.parametrize("module", sorted(REFUSED))
def test_refusals_say_what_to_use_instead(module):
    mod = _cgx(module)
    for name in REFUSED[module]:
        with pytest.raises(NotImplementedError, match=r"not supported by cgx; .*\w"):
            getattr(mod, name)()


def test_docs_table_lists_every_name():
    text = open(DOCS).read()
    section = text[text.index("## API surface"):]
    for module, names in HOROVOD_API.items():
        for n in names:
            assert re.search(rf"`{re.escape(n)}`", section), f"docs/horovod.md misses {module}.{n}"


def _grouped_and_sparse(rank, world):
    import cgx.torch as hvd
    hvd.init()
    out = {}
    a = torch.arange(6.0).view(3, 2) + 10 * rank
    b = torch.full((rank + 1,), float(rank))
    out["gathered"] = hvd.grouped_allgather([a, b])
    out["gathered_async"] = hvd.synchronize(hvd.grouped_allgather_async([a, b]))
    x = torch.arange(10.0, requires_grad=True)
    y = hvd.grouped_reducescatter([x * (rank + 1)], op=hvd.Average)[0]
    (y * (rank + 1)).sum().backward()
    out["rs"], out["rs_grad"] = y.detach(), x.grad
    emb = torch.sparse_coo_tensor([[rank, 3]], [1.0 + rank, 2.0], (5,))
    out["sparse"] = hvd.synchronize(hvd.sparse_allreduce_async(emb, "emb", hvd.Average))
    return out


def test_grouped_reducescatter_gradient_and_sparse_allreduce():
    outs = run_gloo(_grouped_and_sparse, 2)
    for r, o in enumerate(outs):
        a0, a1 = torch.arange(6.0).view(3, 2), torch.arange(6.0).view(3, 2) + 10
        assert torch.equal(o["gathered"][0], torch.cat([a0, a1]))
        assert torch.equal(o["gathered"][1], torch.tensor([0.0, 1.0, 1.0]))
        assert torch.equal(o["gathered_async"][1], o["gathered"][1])
        # Average of x*1 and x*2 = 1.5x; rank 0 keeps rows 0-4, rank 1 rows 5-9.
        assert torch.equal(o["rs"], 1.5 * torch.arange(10.0)[5 * r:5 * r + 5])
        # Horovod's gradient for Average: the allgathered upstream gradients (1 and 2), not
        # divided by the number of ranks, times this rank's factor (r + 1) from x * (rank + 1).
        want = torch.cat([torch.full((5,), 1.0), torch.full((5,), 2.0)]) * (r + 1)
        assert torch.equal(o["rs_grad"], want)
        dense = o["sparse"].to_dense()
        assert torch.equal(dense, torch.tensor([0.5, 1.0, 0.0, 2.0, 0.0]))
