"""cgx.tensorflow: collectives (eager and in tf.function), DistributedGradientTape, validation.

TensorFlow costs seconds and hundreds of MB per process, so the multi-rank
checks run in one 2-rank spawn that returns everything; the parent asserts.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from spawn import run_gloo

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads: no banner
# cgx.tensorflow first: it orders the native libraries (Triton before TensorFlow)
pytest.importorskip("cgx.tensorflow", exc_type=ImportError)
import tensorflow as tf  # noqa: E402

pytestmark = pytest.mark.multiproc

HERE = os.path.dirname(os.path.abspath(__file__))


def _quiet_tf():
    import tensorflow as tf
    try:  # two ranks share two cores: one TF thread each
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    except RuntimeError:
        pass  # already initialized in this process
    return tf


def _sra_bound(local_ranges, mean_range, world, bits, stochastic=True):
    """Max error of a 2-stage SRA average (see cgx.collectives.algorithms)."""
    levels = 2 ** bits - 1
    k = 1.0 if stochastic else 0.5
    stage1 = k * (world - 1) / world * max(local_ranges) / levels
    return 1.01 * (stage1 + k * (mean_range + 2 * stage1) / levels) + 1e-7


class _HalfCompressor:
    """A compressor written for horovod.tensorflow: TF tensors in, TF tensors out."""

    @staticmethod
    def compress(tensor):
        return tf.cast(tensor, tf.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tf.cast(tensor, ctx)


def _grads(tape_cls, model_vars, x, y, **kwargs):
    W, b = model_vars
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(x, W) + b - y))
    if tape_cls is not None:
        tape = tape_cls(tape, **kwargs)
    return tape.gradient(loss, [W, b])


def _world(rank, world):
    tf = _quiet_tf()
    import torch

    import cgx.tensorflow as hvd
    import cgx.torch as thvd
    from cgx.config import Config

    hvd.init(Config())  # defaults: 4 bits, bucket 1024, stochastic rounding
    out = {}
    r = float(rank)
    x = tf.range(6, dtype=tf.float32) + 10 * r

    # -- eager collectives --------------------------------------------------------
    out["avg"] = hvd.allreduce(x).numpy()
    out["sum"] = hvd.allreduce(x, op=hvd.Sum).numpy()
    out["avg_deprecated"] = hvd.allreduce(x, average=False).numpy()
    out["min"] = hvd.allreduce(x, op=hvd.Min).numpy()
    out["max"] = hvd.allreduce(x, op=hvd.Max).numpy()
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).numpy()
    out["int_sum"] = hvd.allreduce(tf.constant([rank + 1]), op=hvd.Sum).numpy()
    out["bool_max"] = hvd.allreduce(tf.constant([rank == 1]), op=hvd.Max).numpy()
    out["dtypes"] = {}  # ranks hold [3, -4] + rank (complex: times 1 - 1j)
    for dt in (tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
               tf.float64, tf.complex64, tf.complex128):
        base = tf.constant([3.0, -4.0]) + rank
        if dt.is_unsigned:
            base = tf.abs(base)
        v = tf.cast(tf.complex(base, -base) if dt.is_complex else base, dt)
        out["dtypes"][dt.name] = [(r.dtype.name, r.numpy().tolist()) for r in (
            hvd.allreduce(v, op=hvd.Sum), hvd.allreduce(v, op=hvd.Average))]
    out["variable"] = hvd.allreduce(tf.Variable(x)).numpy()
    out["grouped"] = [t.numpy() for t in hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)]
    big = tf.random.stateless_normal([5000], seed=[rank, 0])
    out["big"] = big.numpy()
    out["q8"] = hvd.allreduce(big, compression=hvd.Compression.quantize(
        bits=8, rounding="nearest")).numpy()
    out["fp16"] = hvd.allreduce(big, compression=hvd.Compression.fp16).numpy()
    out["user_comp"] = hvd.allreduce(big, compression=_HalfCompressor).numpy()
    out["gather"] = hvd.allgather(tf.fill([rank + 1, 2], r)).numpy()
    out["gather_scalar"] = hvd.allgather(tf.constant(r)).numpy()
    out["bcast"] = hvd.broadcast(tf.constant([r, r]), root_rank=1).numpy()
    out["a2a"] = hvd.alltoall(tf.range(4) + 100 * rank).numpy()
    data, splits = hvd.alltoall(tf.range(3) + 100 * rank, splits=[1, 2] if rank == 0 else [2, 1])
    out["a2a_splits"] = (data.numpy(), splits.numpy())
    sl = tf.IndexedSlices(tf.fill([1, 3], r + 1), tf.constant([rank]), tf.constant([2, 3]))
    red = hvd.allreduce(sl)
    out["slices"] = (type(red).__name__, tf.convert_to_tensor(red).numpy())
    out["obj"] = hvd.broadcast_object({"from": rank}, root_rank=1)
    out["objs"] = hvd.allgather_object(rank * 10)
    hvd.barrier()
    out["sizes"] = (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(),
                    hvd.cross_size(), hvd.cross_rank())
    # torch and TF collectives share one engine: interleaving them stays ordered
    t = thvd.allreduce(torch.full((2,), r), op=thvd.Sum)
    out["mixed"] = (t.numpy(), hvd.allreduce(tf.fill([2], r), op=hvd.Sum).numpy())

    # -- the same inside tf.function (one py_function op each, in program order) ----
    @tf.function
    def graph(a, sp):
        s = hvd.allreduce(a, op=hvd.Sum, name="g.sum")
        m = hvd.allreduce(a, name="g.avg")  # independent of s: ordered by control deps
        g = hvd.allgather(tf.reshape(a, [3, 2]))
        bc = hvd.broadcast(a, root_rank=0)
        d, rs = hvd.alltoall(a, splits=sp)
        grp = hvd.grouped_allreduce([a, 2 * a])
        hvd.barrier()
        return s, m, g, bc, d, rs, grp

    sp = tf.constant([2, 4] if rank == 0 else [3, 3])
    res = graph(x, sp)
    res2 = graph(x + 1, sp)  # a second run of the traced graph
    out["graph"] = [v.numpy() for v in tf.nest.flatten(res)]
    out["graph2_sum"] = res2[0].numpy()
    out["graph_shapes"] = [str(graph.get_concrete_function(x, sp).structured_outputs[2].shape)]

    # -- gradients of the collectives -----------------------------------------------
    w = tf.Variable(tf.ones([3]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allreduce(w * (rank + 1)))
    out["grad_allreduce"] = tape.gradient(loss, w).numpy()
    v = tf.Variable(tf.fill([rank + 1, 2], r))
    c = tf.reshape(tf.range(6, dtype=tf.float32), [3, 2])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allgather(v) * c)
    out["grad_allgather"] = tape.gradient(loss, v).numpy()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.broadcast(w, root_rank=1) * (rank + 1))
    out["grad_broadcast"] = tape.gradient(loss, w).numpy()

    # -- broadcast_variables, eager and in a graph ---------------------------------
    bv = [tf.Variable(tf.fill([4], r)), tf.Variable(rank, dtype=tf.int64)]
    hvd.broadcast_variables(bv, root_rank=1)
    out["bvars"] = [v.numpy() for v in bv]
    gv = tf.Variable(tf.fill([2, 2], r + 5))

    @tf.function
    def bcast_in_graph():
        hvd.broadcast_variables([gv], root_rank=0)

    bcast_in_graph()
    out["bvars_graph"] = gv.numpy()
    # ... and the op it returns, run in a tf.compat.v1 session (resource and ref variables)
    with tf.Graph().as_default():
        sv = [tf.compat.v1.Variable([r + 1.0, 2.0], use_resource=res) for res in (True, False)]
        bcast = hvd.broadcast_variables(sv, root_rank=1)
        with tf.compat.v1.Session() as sess:
            sess.run([v.initializer for v in sv])
            sess.run(bcast)
            out["bvars_session"] = [sess.run(v).tolist() for v in sv]

    # -- DistributedGradientTape ------------------------------------------------------
    rng = np.random.default_rng(0)
    W = tf.Variable(rng.standard_normal((64, 48)).astype("float32"), name="dense/kernel")
    b = tf.Variable(np.zeros(48, "float32"), name="dense/bias")
    data = np.random.default_rng(100 + rank)
    xb = tf.constant(data.standard_normal((32, 64)).astype("float32"))
    yb = tf.constant(data.standard_normal((32, 48)).astype("float32"))
    local = _grads(None, (W, b), xb, yb)
    out["tape_local"] = [g.numpy() for g in local]
    out["tape_exact"] = [g.numpy() for g in _grads(
        hvd.DistributedGradientTape, (W, b), xb, yb, compression=hvd.Compression.exact)]
    out["tape_default"] = [g.numpy() for g in _grads(hvd.DistributedGradientTape, (W, b), xb, yb)]
    out["tape_sum"] = [g.numpy() for g in _grads(
        hvd.DistributedGradientTape, (W, b), xb, yb, op=hvd.Sum,
        compression=hvd.Compression.exact)]
    out["tape_predivide"] = [g.numpy() for g in _grads(
        hvd.DistributedGradientTape, (W, b), xb, yb, gradient_predivide_factor=2.0,
        compression=hvd.Compression.exact)]
    # layer rules see the variable's name: excluding the kernel sends it exact
    out["tape_rules"] = [g.numpy() for g in _grads(
        hvd.DistributedGradientTape, (W, b), xb, yb,
        rules={"layers": [{"pattern": "*kernel", "exclude": True}]})]
    out["tape_named"] = [g.numpy() for g in _grads(
        hvd.DistributedGradientTape, (W, b), xb, yb, named_variables=[("fc.w", W), ("fc.b", b)],
        rules=[{"pattern": "fc.w", "exclude": True}])]
    for key, comp in (("fp16", hvd.Compression.fp16), ("topk", hvd.Compression.topk(0.3)),
                      ("powersgd", hvd.Compression.powersgd(rank=2)),
                      ("user", _HalfCompressor)):
        out[f"tape_{key}"] = [g.numpy() for g in _grads(hvd.DistributedGradientTape, (W, b),
                                                        xb, yb, compression=comp)]

    @tf.function
    def step(xs, ys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(xs, W) + b - ys))
        tape = hvd.DistributedGradientTape(tape)
        gw, gb = tape.gradient(loss, [W, b])
        W.assign_sub(0.1 * gw)
        b.assign_sub(0.1 * gb)
        return loss

    for _ in range(2):
        step(xb, yb)
    out["tape_graph_params"] = [W.numpy(), b.numpy()]
    # None (unconnected) and IndexedSlices (tf.gather) gradients, nested sources
    E = tf.Variable(tf.ones([10, 4]), name="emb")
    unused = tf.Variable(tf.ones([3]), name="unused")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(E, [rank, 5]) * (rank + 1))
    g = hvd.DistributedGradientTape(tape).gradient(loss, {"e": E, "u": unused})
    out["tape_sparse"] = (g["u"] is None, type(g["e"]).__name__,
                          tf.convert_to_tensor(g["e"]).numpy())

    @tf.function(input_signature=[tf.TensorSpec([None])])
    def dynamic(a):
        with tf.GradientTape() as tape:
            tape.watch(a)
            loss = tf.reduce_sum(a * a)
        return hvd.DistributedGradientTape(tape).gradient(loss, a)

    try:
        dynamic(tf.ones([3]))
        out["dynamic"] = "no error"
    except ValueError as exc:
        out["dynamic"] = str(exc)
    return out


def test_collectives_and_tape_on_two_ranks():
    r0, r1 = run_gloo(_world, 2, timeout=300)
    x0, x1 = np.arange(6.0), np.arange(6.0) + 10
    for r, out in enumerate((r0, r1)):
        np.testing.assert_array_equal(out["avg"], (x0 + x1) / 2)
        np.testing.assert_array_equal(out["sum"], x0 + x1)
        np.testing.assert_array_equal(out["avg_deprecated"], x0 + x1)
        np.testing.assert_array_equal(out["min"], x0)
        np.testing.assert_array_equal(out["max"], x1)
        np.testing.assert_array_equal(out["scaled"], x0 + x1)
        assert out["int_sum"].tolist() == [3] and out["int_sum"].dtype == np.int32
        assert out["bool_max"].tolist() == [True]
        # every dtype keeps its type; integers average as Horovod (trunc), complex
        # numbers keep their imaginary part
        for name, (summed, averaged) in out["dtypes"].items():
            assert summed[0] == averaged[0] == name, name
            if name == "uint8":  # [3, 4] and [4, 3]
                assert (summed[1], averaged[1]) == ([7, 7], [3, 3])
            elif "int" in name:  # [3, -4] and [4, -3]
                assert (summed[1], averaged[1]) == ([7, -7], [3, -3]), name
            elif "complex" in name:
                assert (summed[1], averaged[1]) == ([7 - 7j, -7 + 7j],
                                                    [3.5 - 3.5j, -3.5 + 3.5j]), name
            else:
                assert (summed[1], averaged[1]) == ([7.0, -7.0], [3.5, -3.5]), name
        np.testing.assert_array_equal(out["variable"], (x0 + x1) / 2)
        np.testing.assert_array_equal(out["grouped"][1], 2 * (x0 + x1))
        exact = (r0["big"] + r1["big"]) / 2
        assert np.abs(out["q8"] - exact).max() < 8 / 255 * 2 * 4  # two 8-bit quantizations
        assert np.abs(out["fp16"] - exact).max() < 1e-2
        assert np.abs(out["user_comp"] - exact).max() < 1e-2
        np.testing.assert_array_equal(out["gather"], [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_array_equal(out["gather_scalar"], [0, 1])
        np.testing.assert_array_equal(out["bcast"], [1, 1])
        assert out["slices"][0] == "IndexedSlices"
        np.testing.assert_allclose(out["slices"][1], [[0.5] * 3, [1.0] * 3])
        assert out["obj"] == {"from": 1} and out["objs"] == [0, 10]
        assert out["sizes"][:2] == (2, r)
        assert out["mixed"][0].tolist() == [1.0, 1.0] and out["mixed"][1].tolist() == [1.0, 1.0]
        # graph mode: same values as eager
        s, m, g, bc, d, rs, grp0, grp1 = out["graph"]
        np.testing.assert_array_equal(s, x0 + x1)
        np.testing.assert_array_equal(m, (x0 + x1) / 2)
        np.testing.assert_array_equal(g, np.concatenate([x0, x1]).reshape(6, 2))
        np.testing.assert_array_equal(bc, x0)
        np.testing.assert_array_equal(grp1, x0 + x1)
        np.testing.assert_array_equal(out["graph2_sum"], x0 + x1 + 2)
        assert out["graph_shapes"] == ["(None, 2)"]
        # gradients
        np.testing.assert_array_equal(out["grad_allreduce"], np.full(3, r + 1.0))
        rows = slice(0, 1) if r == 0 else slice(1, 3)
        # Horovod's rules: averaged over the ranks (then this rank's rows / the root only).
        np.testing.assert_array_equal(out["grad_allgather"], np.arange(6.0).reshape(3, 2)[rows])
        np.testing.assert_array_equal(out["grad_broadcast"], np.full(3, 1.5 if r == 1 else 0.0))
        np.testing.assert_array_equal(out["bvars"][0], np.ones(4))
        assert out["bvars"][1] == 1
        np.testing.assert_array_equal(out["bvars_graph"], np.full((2, 2), 5.0))
        assert out["bvars_session"] == [[2.0, 2.0], [2.0, 2.0]]
        assert "cgx reduces gradients of static shape" in out["dynamic"]
    # alltoall, eager and in the graph (rank 0 sends 2 rows to 0 and 4 to 1; rank 1 3 and 3)
    assert r0["a2a"].tolist() == [0, 1, 100, 101] and r1["a2a"].tolist() == [2, 3, 102, 103]
    assert r0["a2a_splits"][0].tolist() == [0, 100, 101] and r0["a2a_splits"][1].tolist() == [1, 2]
    assert r1["a2a_splits"][0].tolist() == [1, 2, 102]
    assert r0["graph"][4].tolist() == [0, 1, 10, 11, 12] and r0["graph"][5].tolist() == [2, 3]
    assert r1["graph"][4].tolist() == [2, 3, 4, 5, 13, 14, 15] and r1["graph"][5].tolist() == [4, 3]
    np.testing.assert_array_equal(r0["q8"], r1["q8"])

    # DistributedGradientTape
    mean = [(a + b) / 2 for a, b in zip(r0["tape_local"], r1["tape_local"])]
    for out in (r0, r1):
        for got, want in zip(out["tape_exact"], mean):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        for got, want in zip(out["tape_sum"], mean):
            np.testing.assert_allclose(got, 2 * want, rtol=1e-6, atol=1e-7)
        for got, want in zip(out["tape_predivide"], mean):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        # default: the 64x48 kernel is quantized to 4 bits (within the SRA bound, not exact),
        # the bias travels exact
        gw, gb = out["tape_default"]
        ranges = [float(g[0].max() - g[0].min()) for g in (r0["tape_local"], r1["tape_local"])]
        bound = _sra_bound(ranges, float(mean[0].max() - mean[0].min()), 2, 4)
        err = np.abs(gw - mean[0]).max()
        assert 0 < err <= bound, (err, bound)
        np.testing.assert_allclose(gb, mean[1], rtol=1e-6, atol=1e-7)
        for key in ("tape_rules", "tape_named"):  # kernel excluded by name: exact
            np.testing.assert_allclose(out[key][0], mean[0], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(out["tape_fp16"][0], mean[0], atol=1e-2)
        np.testing.assert_allclose(out["tape_user"][0], mean[0], atol=1e-2)
        none, kind, e = out["tape_sparse"]
        assert none and kind == "IndexedSlices"  # sparse_as_dense=False keeps it (Horovod)
        np.testing.assert_allclose(e[:2], [[0.5] * 4, [1.0] * 4])
        np.testing.assert_allclose(e[5], [1.5] * 4)
    for key in ("tape_default", "tape_topk", "tape_powersgd", "tape_graph_params"):
        for a, b in zip(r0[key], r1[key]):
            np.testing.assert_array_equal(a, b, err_msg=key)  # bit-identical on every rank


# -- single process: validation, XLA, imports ------------------------------------------

@pytest.fixture
def hvd():
    import cgx.tensorflow as hvd
    from cgx.config import Config
    hvd.init(Config())
    yield hvd
    hvd.shutdown()


def test_validation_errors(hvd):
    import torch

    from cgx.exchange import GradientPlan
    x = tf.ones([4])
    with pytest.raises(ValueError, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(ValueError, match="op and average cannot both"):
        hvd.allreduce(x, op=hvd.Sum, average=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be a ProcessSet"):
        hvd.allreduce(x, process_set=object())
    with pytest.raises(tf.errors.InvalidArgumentError, match="is not registered"):
        hvd.allreduce(x, process_set=hvd.ProcessSet([0]))
    with pytest.raises(TypeError, match="compression must be"):
        hvd.allreduce(x, compression="fp16")
    with pytest.raises(ValueError, match="IndexedSlices supports op Average or Sum"):
        hvd.allreduce(tf.IndexedSlices(x, tf.constant([0, 1, 2, 3])), op=hvd.Max)
    with pytest.raises(ValueError, match="grouped_allreduce takes dense"):
        hvd.grouped_allreduce([tf.IndexedSlices(x, tf.constant([0, 1, 2, 3]))])
    with pytest.raises(ValueError, match="root_rank must be a rank"):
        hvd.broadcast(x, root_rank=1)
    with pytest.raises(ValueError, match="root_rank must be a rank"):
        hvd.broadcast_variables([tf.Variable(x)], root_rank=-1)
    with pytest.raises(ValueError, match="splits must hold"):
        hvd.alltoall(x, splits=[3])
    with pytest.raises(TypeError, match="numeric or bool"):
        hvd.allreduce(tf.constant(["a"]))
    with pytest.raises(TypeError, match="tf.GradientTape"):
        hvd.DistributedGradientTape(object())
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match="already a DistributedGradientTape"):
        hvd.DistributedGradientTape(hvd.DistributedGradientTape(tape))
    with pytest.raises(ValueError, match="op must be Average or Sum"):
        hvd.DistributedGradientTape(tape, op=hvd.Min)
    with pytest.raises(ValueError, match="applies to op=Average"):
        hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="gradient_predivide_factor must be"):
        hvd.DistributedGradientTape(tape, gradient_predivide_factor=0)
    with pytest.raises(ValueError, match="named_variables should be"):
        hvd.DistributedGradientTape(tape, named_variables=[tf.Variable(x)])
    with pytest.raises(ValueError, match="2 names for 1 shapes"):
        GradientPlan(["a", "b"], [(2,)])
    with pytest.raises(ValueError, match="Average or Sum"):
        GradientPlan(["a"], [(2,)], op=hvd.Max)
    with pytest.raises(ValueError, match="GradientPlan state"):
        GradientPlan(["a"], [(2,)]).load_state_dict({"format": 0})
    with pytest.raises(ValueError, match="plan is for 1 gradients, got 2"):
        GradientPlan(["a"], [(2,)]).reduce([torch.zeros(2), torch.zeros(2)], name="p")


def test_several_replicas_per_process_are_refused(hvd, monkeypatch):
    from cgx.tensorflow.gradients import GradientExchange

    class TwoReplicas:
        num_replicas_in_sync = 2

    monkeypatch.setattr(tf.distribute, "get_strategy", lambda: TwoReplicas())
    with pytest.raises(ValueError, match="one model replica each"):
        GradientExchange()([tf.ones([2])], [tf.Variable(tf.ones([2]))])
    with pytest.raises(ValueError, match="got 1 gradients for 2 variables"):
        GradientExchange()([tf.ones([2])], [tf.Variable(tf.ones([2]))] * 2)


def test_single_rank_is_identity_and_plan_modes(hvd):
    from cgx.exchange import GradientPlan, unique_names
    w = tf.Variable(tf.ones([64, 64]), name="w")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * 3.0)
    g = hvd.DistributedGradientTape(tape).gradient(loss, w)
    np.testing.assert_array_equal(g.numpy(), np.full((64, 64), 3.0))
    modes = {name: GradientPlan(["w"], [(64, 64)], comp).mode.value for name, comp in (
        ("none", hvd.Compression.none), ("exact", hvd.Compression.exact),
        ("fp16", hvd.Compression.fp16), ("q8", hvd.Compression.quantize(bits=8)),
        ("topk", hvd.Compression.topk(0.1)))}
    # the default (Compression.none) is the deciding exchange: a plan of the whole model
    assert modes == {"none": "auto", "exact": "exact", "fp16": "summable", "q8": "quantize",
                     "topk": "per_tensor"}
    plan = GradientPlan(["big", "bias", "small"], [(64, 64), (64,), (8, 8)])
    assert [s and s.bits for s in plan.specs] == [4, None, None]
    assert plan.compressed_numel == 4096
    assert unique_names(["a", None, "a", "a"], "p") == ["a", "p.noname.1", "a.1", "a.2"]
    import torch
    bias = torch.arange(64.0)
    (out,) = plan.reduce([bias.clone()], name="p", indices=[1])  # one bucket of the plan
    assert torch.equal(out, bias) and plan.step == 1
    state = plan.state_dict()
    plan.step = 5
    plan.load_state_dict(state)
    assert plan.step == 1


def test_xla_is_refused_with_a_clear_error(hvd):
    @tf.function(jit_compile=True)
    def f(x):
        return hvd.allreduce(x)

    with pytest.raises(hvd.XLAUnsupportedError, match="jit_compile=False"):
        f(tf.ones([2]))


def test_bridge_copies_misaligned_results_and_shares_aligned_ones():
    import torch

    from cgx.tensorflow._bridge import TF_ALIGNMENT, copy_to_torch, to_tf, to_torch
    base = torch.arange(17, dtype=torch.float32)
    view = base[1:]  # 4 bytes past a 64-byte boundary: TF would abort on it
    assert view.data_ptr() % TF_ALIGNMENT
    np.testing.assert_array_equal(to_tf(view).numpy(), np.arange(1, 17))
    t = torch.zeros(4)
    shared = to_tf(t)
    t[0] = 7  # zero-copy: TF sees torch's memory
    assert shared.numpy()[0] == 7
    x = tf.constant([1.0, 2.0])
    assert to_torch(x).tolist() == [1.0, 2.0]
    c = copy_to_torch(x)
    c[0] = 5
    assert x.numpy()[0] == 1.0  # a copy never writes into TF's buffer
    for dtype in (tf.bfloat16, tf.float16, tf.int64, tf.bool):
        v = tf.cast(tf.constant([1, 0]), dtype)
        assert to_tf(to_torch(v)).dtype == dtype


def test_imports_need_no_tensorflow_and_missing_tensorflow_is_named():
    code = (
        "import sys\n"
        "import cgx, cgx.torch\n"
        "assert 'tensorflow' not in sys.modules, 'cgx/cgx.torch imported TensorFlow'\n"
        "sys.modules['tensorflow'] = None  # as if it were not installed\n"
        "from cgx.errors import MissingDependencyError\n"
        "try:\n"
        "    import cgx.tensorflow\n"
        "except MissingDependencyError as e:\n"
        "    assert \"pip install 'cgx[tensorflow]'\" in str(e), e\n"
        "    print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(HERE), timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_keras_adapter_needs_keras_3_on_the_tensorflow_backend():
    code = (
        "import os, sys\n"
        "from cgx.errors import MissingDependencyError\n"
        "sys.modules['keras'] = None  # as if it were not installed\n"
        "try:\n"
        "    import cgx.tensorflow.keras\n"
        "except MissingDependencyError as e:\n"
        "    print('missing:', e)\n"
        "del sys.modules['keras']\n"
        "os.environ['KERAS_BACKEND'] = 'torch'  # read when keras loads\n"
        "try:\n"
        "    import cgx.tensorflow.keras\n"
        "except ImportError as e:\n"
        "    print('backend:', e)\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("KERAS_BACKEND", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(HERE), timeout=120, env=env)
    assert "missing: cgx.tensorflow.keras (the Keras adapter) needs" in res.stdout, res.stderr
    assert "backend: " in res.stdout and "set KERAS_BACKEND=tensorflow" in res.stdout, \
        (res.stdout, res.stderr)
