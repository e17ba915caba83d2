"""cgx.tensorflow inside TensorFlow graphs (a ``tf.compat.v1`` session and ``tf.function``),
side by side with Horovod 0.28.1:

* many collectives that the executor may start in any order (one allreduce and one
  allgather per dtype and rank count, Horovod's fusion test) complete with exact sums;
* auto-generated names are the same on every rank (a function traced on one rank only
  shifts nothing; the broadcast's gradient runs on every rank);
* ranks that disagree get ``FailedPreconditionError``, bad arguments
  ``InvalidArgumentError``, and the job goes on;
* ``allreduce`` of ``tf.IndexedSlices`` gathers and averages the slices, and
  ``DistributedGradientTape`` reduces sparse gradients in a ``tf.function``.

The rank program is :func:`graph_program`; ``python tests/test_tensorflow_graph.py
horovod|cgx`` runs it under a launcher. One 2-rank spawn runs it under cgx.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

pytestmark = pytest.mark.multiproc

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
MISMATCHES = ("allreduce_shape", "allreduce_dtype", "allgather_shape", "broadcast_root",
              "broadcast_shape")
BAD_ARGUMENTS = ("alltoall_splits_count", "alltoall_splits_sum", "alltoall_rows")


def _error(fn) -> str:
    try:
        fn()
        return "no error"
    except Exception as e:  # noqa: BLE001 - the type is what the test compares
        return type(e).__name__


def _in_session(build):
    """``build()``'s tensors evaluated by a ``tf.compat.v1`` session over a fresh graph."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        fetches = build()
    with tf.compat.v1.Session(graph=graph) as sess:
        return sess.run(fetches)


def _lists(values) -> list:
    import numpy as np
    return [np.asarray(v).tolist() for v in values]


def _many(hvd, r):
    """One Sum allreduce and one allgather per dtype and rank count, all independent."""
    import tensorflow as tf

    def build():
        sums, gathers = [], []
        for dt, dim in itertools.product(DTYPES, [1, 2, 3]):
            t = tf.cast(tf.reshape(tf.range(2 ** dim) % 7, [2] * dim) + r, getattr(tf, dt))
            sums.append(hvd.allreduce(t, op=hvd.Sum))
            gathers.append(hvd.allgather(t))
        return sums + gathers
    return build


def _names(hvd, r, out):
    """A function traced on rank 0 only; then unnamed collectives eagerly and in graphs."""
    import tensorflow as tf
    if r == 0:
        tf.function(lambda: hvd.allreduce(tf.ones([3]))).get_concrete_function()
    out["eager_unnamed"] = hvd.allreduce(tf.constant([1.0, 2.0]) * (r + 1)).numpy().tolist()

    def broadcast_grad():
        x = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
        y = hvd.broadcast(x, root_rank=1)
        return [y, tf.gradients(y * (r + 1.0), x)[0]]
    out["broadcast_grad_session"] = _lists(_in_session(broadcast_grad))
    v = tf.Variable([1.0, 2.0, 3.0])

    @tf.function
    def tape_grad():
        with tf.GradientTape() as tape:
            y = hvd.broadcast(v * (r + 1), root_rank=1)
            loss = tf.reduce_sum(y * (r + 1.0))
        return [y, tape.gradient(loss, v)]
    out["broadcast_grad_function"] = _lists(tape_grad())


def _error_cases(hvd, r) -> dict:
    import tensorflow as tf
    return {
        "allreduce_shape": lambda: hvd.allreduce(tf.ones([2 + r]), name="e_shape"),
        "allreduce_dtype": lambda: hvd.allreduce(
            tf.ones([2], tf.float32 if r == 0 else tf.float64), name="e_dtype"),
        "allgather_shape": lambda: hvd.allgather(tf.ones([2, 2 + r]), name="e_gather"),
        "broadcast_root": lambda: hvd.broadcast(tf.ones([2]), root_rank=r, name="e_root"),
        "broadcast_shape": lambda: hvd.broadcast(tf.ones([2 + r]), root_rank=0, name="e_bshape"),
        # (Horovod 0.28.1 lets splits that sum to fewer rows pass, and aborts on negative ones)
        "alltoall_splits_count": lambda: hvd.alltoall(tf.ones([4]), splits=tf.constant([1, 1, 2]),
                                                      name="e_count"),
        "alltoall_splits_sum": lambda: hvd.alltoall(tf.ones([4]), splits=tf.constant([3, 3]),
                                                    name="e_sum"),
        "alltoall_rows": lambda: hvd.alltoall(tf.ones([3]), name="e_rows")}


def _errors(hvd, r, out):
    import tensorflow as tf
    cases = _error_cases(hvd, r)
    out["errors_session"] = {k: _error(lambda f=f: _in_session(lambda: [f()])) for k, f in
                             cases.items()}
    out["errors_function"] = {k: _error(tf.function(f)) for k, f in cases.items()}
    out["errors_eager"] = {k: _error(f) for k, f in cases.items()}
    out["after_errors"] = hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum).numpy().tolist()


def _sparse(hvd, r, out):
    import tensorflow as tf

    def build():
        s = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 5.0]]) * (r + 1),
                             tf.constant([r, 2], tf.int64), dense_shape=tf.constant([4, 2]))
        avg, total = hvd.allreduce(s), hvd.allreduce(s, op=hvd.Sum)
        return [avg.values, avg.indices, total.values, total.indices]
    out["sparse_session"] = _lists(_in_session(build))
    out["sparse_function"] = _lists(tf.function(build)())
    table = tf.Variable(tf.reshape(tf.range(12.0), (4, 3)))
    for dense in (False, True):
        @tf.function
        def tape_grad():
            with tf.GradientTape() as tape:
                rows = tf.gather(table, tf.constant([r, 3]))
                loss = tf.reduce_sum(rows * tf.constant([1.0, 2.0, 3.0]))
            tape = hvd.DistributedGradientTape(tape, sparse_as_dense=dense)
            return tf.convert_to_tensor(tape.gradient(loss, [table])[0])
        out[f"tape_sparse_as_dense_{dense}"] = tape_grad().numpy().tolist()


def graph_program(hvd) -> dict:
    import tensorflow as tf
    hvd.init()
    r = hvd.rank()
    out = {"many_session": _lists(_in_session(_many(hvd, r))),
           "many_function": _lists(tf.function(_many(hvd, r))())}
    _names(hvd, r, out)
    _errors(hvd, r, out)
    _sparse(hvd, r, out)
    return out


# -- the tests ----------------------------------------------------------------------------

def _cgx_rank(rank, world):
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)  # few threads: no slack
    import cgx.tensorflow as hvd
    return graph_program(hvd)


_report: list = []


def _cgx() -> list:
    if not _report:
        from spawn import run_gloo
        _report.extend(json.loads(json.dumps(run_gloo(_cgx_rank, 2, timeout=300))))
    return _report


def _expected_many(r: int) -> list:
    import numpy as np
    sums, gathers = [], []
    for dt, dim in itertools.product(DTYPES, [1, 2, 3]):
        base = (np.arange(2 ** dim) % 7).reshape([2] * dim)
        sums.append((base * 2 + 1).astype(dt).tolist())  # ranks 0 and 1 add 0 and 1
        gathers.append(np.concatenate([base, base + 1]).astype(dt).tolist())
    return sums + gathers


def test_many_graph_collectives_complete_in_an_agreed_order():
    for r, rep in enumerate(_cgx()):
        assert rep["many_session"] == _expected_many(r)
        assert rep["many_function"] == _expected_many(r)


def test_auto_names_agree_across_ranks():
    for r, rep in enumerate(_cgx()):
        assert rep["eager_unnamed"] == [1.5, 3.0]
        # averaged onto root 1, zeros elsewhere (then times r + 1 for the tape's variable)
        want = [[2.0, 4.0, 6.0], [0.0] * 3 if r == 0 else [1.5] * 3]
        assert rep["broadcast_grad_session"] == want
        assert rep["broadcast_grad_function"] == [want[0], [x * (r + 1) for x in want[1]]]


def test_graph_errors_have_horovods_types():
    want = {k: "FailedPreconditionError" for k in MISMATCHES}
    want.update({k: "InvalidArgumentError" for k in BAD_ARGUMENTS})
    for rep in _cgx():
        for mode in ("session", "function", "eager"):
            assert rep[f"errors_{mode}"] == want, mode
        assert rep["after_errors"] == [1.0]


def test_indexed_slices_in_graphs():
    for r, rep in enumerate(_cgx()):
        values = [[1.0, 2.0], [3.0, 5.0], [2.0, 4.0], [6.0, 10.0]]
        want = [[[a / 2 for a in v] for v in values], [0, 2, 1, 2], values, [0, 2, 1, 2]]
        assert rep["sparse_session"] == want
        assert rep["sparse_function"] == want
        # rows r and 3 of each rank, weighted 1, 2, 3, averaged over the 2 ranks
        dense = [[0.5, 1.0, 1.5], [0.5, 1.0, 1.5], [0.0] * 3, [1.0, 2.0, 3.0]]
        assert rep["tape_sparse_as_dense_False"] == dense
        assert rep["tape_sparse_as_dense_True"] == dense


def test_matches_horovod(horovodrun):
    from distutil import run_ranks
    theirs = run_ranks(path=__file__, nprocs=2, launcher="horovodrun", args=["horovod"],
                       launcher_args=["--gloo"], timeout=300).check()
    for r, (mine, hers) in enumerate(zip(_cgx(), theirs)):
        assert sorted(mine) == sorted(hers)
        for key in hers:
            assert mine[key] == hers[key], f"rank {r}: {key}"


if __name__ == "__main__":
    from distutil import report
    hvd = importlib.import_module(f"{sys.argv[1]}.tensorflow")
    report(graph_program(hvd))
    hvd.shutdown()
