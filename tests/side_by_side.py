"""Rank programs run twice: under Horovod (horovodrun) and under cgx (cgxrun), the same code
with only the import swapped; the tests compare the two reports value by value.

    python tests/side_by_side.py horovod|cgx CASE

Each case returns a JSON-able dict (results, and the type names of expected errors).
"""

from __future__ import annotations

import importlib
import sys

import torch

from distutil import report


def _err(fn):
    """``fn()``'s result, or the name of the exception type it raised."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the type is what the tests compare
        return type(e).__name__


def case_process_sets(hvd) -> dict:
    ps_a, ps_b = hvd.ProcessSet([2, 0]), hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[ps_a, ps_b])
    r = hvd.rank()
    out = {"ids": [ps_a.process_set_id, ps_b.process_set_id],
           "sizes": [ps_a.size(), ps_b.size()], "included": [ps_a.included(), ps_b.included()],
           "ranks": [ps_a.ranks, ps_b.ranks], "global_ranks": hvd.global_process_set.ranks,
           "set_ranks": [_err(ps_a.rank), _err(ps_b.rank)]}
    x = torch.arange(4.0) + 10 * r
    if ps_a.included():
        out["a_avg"] = hvd.allreduce(x, name="a", process_set=ps_a).tolist()
        out["a_sum_int"] = hvd.allreduce(torch.tensor([r + 1, 3 * r], dtype=torch.int32),
                                         name="ai", op=hvd.Sum, process_set=ps_a).tolist()
        out["a_gather"] = hvd.allgather(torch.full((r + 1, 2), float(r)), name="ag",
                                        process_set=ps_a).tolist()
        out["a_bcast"] = hvd.broadcast(x, root_rank=2, name="ab", process_set=ps_a).tolist()
        out["a_rs"] = hvd.reducescatter(torch.arange(6.0).view(3, 2) * (r + 1), name="ars",
                                        op=hvd.Sum, process_set=ps_a).tolist()
        out["a_a2a"] = hvd.alltoall(torch.arange(4.0) + 100 * r, name="aa",
                                    process_set=ps_a).tolist()
        out["a_grouped"] = [t.tolist() for t in hvd.grouped_allreduce(
            [x, x * 2], name="agr", process_set=ps_a)]
        out["a_obj"] = hvd.broadcast_object({"from": r}, root_rank=2, process_set=ps_a)
        hvd.barrier(process_set=ps_a)
    else:
        out["a_err"] = _err(lambda: hvd.allreduce(x, name="a", process_set=ps_a))
    if ps_b.included():
        out["b_avg"] = hvd.allreduce(x, name="b", process_set=ps_b).tolist()
    out["world"] = hvd.allreduce(x, name="w").tolist()
    return out


def case_sparse(hvd) -> dict:
    """An embedding with sparse gradients trained by SparseAdam (sparse_as_dense=False), and
    the same model densified (sparse_as_dense=True) with SGD."""
    hvd.init()
    r = hvd.rank()
    out = {}
    for dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(12, 3, sparse=True)
        inner = torch.optim.SGD(emb.parameters(), lr=0.5) if dense else \
            torch.optim.SparseAdam(emb.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(inner, named_parameters=emb.named_parameters(),
                                       sparse_as_dense=dense)
        for step in range(3):
            opt.zero_grad()
            ids = torch.tensor([(r * 5 + step * 3 + k) % 12 for k in range(4)])
            (emb(ids) * torch.arange(1.0, 4.0)).sum().backward()
            opt.step()
        out["dense" if dense else "sparse"] = emb.weight.detach().tolist()
        out["grad_is_sparse" if not dense else "dense_grad_is_sparse"] = emb.weight.grad.is_sparse
    return out


def case_sparse_tf(hvd) -> dict:
    """IndexedSlices gradients through DistributedGradientTape, sparse and densified."""
    import tensorflow as tf

    hvd.init()
    r = hvd.rank()
    table = tf.Variable(tf.reshape(tf.range(24.0), (8, 3)))
    out = {}
    for dense in (False, True):
        with tf.GradientTape() as tape:
            rows = tf.gather(table, tf.constant([r, r + 2, 5]))
            loss = tf.reduce_sum(rows * tf.constant([1.0, 2.0, 3.0]))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=dense)
        (g,) = tape.gradient(loss, [table])
        key = "dense" if dense else "sparse"
        out[key + "_type"] = type(g).__name__
        out[key] = tf.convert_to_tensor(g).numpy().tolist()
    return out


def case_partial_tf(hvd) -> dict:
    """register_local_source: a shared variable averaged, a local one kept per rank (divided
    by the number of ranks, Horovod's scale_local_gradients). tf.Variables: Horovod 0.28.1's
    PartialDistributedGradientTape cannot take Keras 3 layers (their variables lack .ref())."""
    import tensorflow as tf

    hvd.init()
    r = hvd.rank()
    shared = tf.Variable([[1.0, -1.0], [0.5, 2.0], [0.0, 1.0]])
    local = tf.Variable([[1.0 + r], [2.0]])
    x = tf.constant([[1.0, 2.0, 3.0]]) * (r + 1)
    out = {}
    for scale in (True, False):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.matmul(x, shared), local))
        tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
        tape.register_local_source(local)
        grads = tape.gradient(loss, [shared, local])
        out[f"grads_{scale}"] = [g.numpy().tolist() for g in grads]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(tf.matmul(x, shared), local))
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(local)
    loc, glob = tape.get_local_and_global_gradients(loss, [shared, local])
    out["split"] = [len(loc), len(glob)]
    return out


def case_process_sets_tf(hvd) -> dict:
    import tensorflow as tf

    ps = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[ps])
    r = hvd.rank()
    out = {"included": ps.included(), "size_op": int(hvd.size_op(ps.process_set_id)),
           "included_op": int(hvd.process_set_included_op(ps.process_set_id))}
    x = tf.constant([1.0, 2.0]) * (r + 1)
    if ps.included():
        out["avg"] = hvd.allreduce(x, name="a", process_set=ps).numpy().tolist()
        out["gather"] = hvd.allgather(tf.fill([r + 1], float(r)), name="g",
                                      process_set=ps).numpy().tolist()
        out["bcast"] = hvd.broadcast(x, root_rank=2, name="b", process_set=ps).numpy().tolist()
        v = tf.Variable([float(r)])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * x)
        tape = hvd.DistributedGradientTape(tape, process_set=ps)
        out["tape"] = tape.gradient(loss, [v])[0].numpy().tolist()
    else:
        out["err"] = _err(lambda: hvd.allreduce(x, name="a", process_set=ps))
    out["world"] = hvd.allreduce(x, name="w").numpy().tolist()
    return out


def case_broadcast_inplace_tf(hvd) -> dict:
    """``hvd.broadcast_([var], root_rank)`` in a ``tf.compat.v1`` session (reference and
    resource variables), in a ``tf.function`` and eagerly, from every root: what the
    returned tensor and the variable hold afterwards (Horovod's
    test_horovod_broadcast_inplace_cpu, in small)."""
    import tensorflow as tf
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    for root in range(n):
        for dtype in (tf.int8, tf.int64, tf.float16, tf.float32, tf.bool):
            def start():
                return tf.cast(tf.ones([3, 2]) * (r % 2 if dtype == tf.bool else r), dtype)
            for use_resource in (False, True):
                with tf.Graph().as_default():
                    var = tf.compat.v1.Variable(start(), use_resource=use_resource)
                    with tf.compat.v1.Session() as sess:
                        sess.run(tf.compat.v1.global_variables_initializer())
                        b, = hvd.broadcast_([var], root)
                        out[f"graph-{'resource' if use_resource else 'ref'}-{dtype.name}-{root}"] \
                            = [sess.run(b).tolist(), sess.run(var).tolist(), b.dtype.name]
            var = tf.Variable(start())
            b, = hvd.broadcast_([var], root)
            out[f"eager-{dtype.name}-{root}"] = [b.numpy().tolist(), var.numpy().tolist()]
            var = tf.Variable(start())
            fn = tf.function(lambda v=var, root=root: hvd.broadcast_([v], root)[0])
            out[f"function-{dtype.name}-{root}"] = [fn().numpy().tolist(), var.numpy().tolist()]
    return out


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


def main() -> None:
    impl, case = sys.argv[1], sys.argv[2]
    if impl not in ("horovod", "cgx"):
        sys.exit(f"usage: {sys.argv[0]} horovod|cgx CASE")
    if case.endswith("_tf"):
        hvd = importlib.import_module(f"{impl}.tensorflow")
    else:
        hvd = importlib.import_module(f"{impl}.torch")
    report(CASES[case](hvd))
    hvd.shutdown()


if __name__ == "__main__":
    main()
