"""Keras reliability reproductions on real ranks: broadcast timing, accumulation, mixed precision,
layer rules given as containers. One 2-rank spawn runs every scenario (TensorFlow costs
seconds per process)."""

import os

import numpy as np
import pytest

from spawn import run_gloo

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("cgx.tensorflow", exc_type=ImportError)
import tensorflow as tf  # noqa: E402
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.multiproc

BATCH, STEPS = 4, 4


def _data(n):
    g = np.random.default_rng(7)
    x = g.normal(size=(n, 8)).astype("float32")
    return x, (x @ g.normal(size=(8, 3))).astype("float32")


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])


def _train_bpps(hvd, x, y, seed, world, rank):
    """bpps=2 with the broadcast callback, exact exchange; returns the final weights."""
    model = _model(seed)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                   average_aggregated_gradients=True,
                                   compression=hvd.Compression.exact)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    n = len(x) // world
    model.fit(x[rank * n:(rank + 1) * n] if world > 1 else x,
              y[rank * n:(rank + 1) * n] if world > 1 else y,
              batch_size=BATCH if world > 1 else BATCH * 2, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return [w.tolist() for w in model.get_weights()]


def _keras_scenarios(rank, world):
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import cgx.tensorflow.keras as hvd
    hvd.init()
    out = {}
    # Each rank trains on its own contiguous half, so that rank r's batch k is the
    # r-th half of the global batch k of the single-process reference.
    x, y = _data(BATCH * STEPS * world)
    xs = np.concatenate([x[r::world] for r in range(world)])
    ys = np.concatenate([y[r::world] for r in range(world)])
    out["bpps"] = _train_bpps(hvd, xs, ys, seed=rank, world=world, rank=rank)

    # Layer rules as a dict and as a list are accepted as they are.
    for kind, rules in (("dict", {"layers": [{"pattern": "*kernel*", "bits": 8}]}),
                        ("list", [{"pattern": "*", "exclude": True}])):
        model = _model(0)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), rules=rules),
                      loss="mse", jit_compile=False)
        hist = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                         callbacks=[hvd.callbacks.StatsCallback(layer_errors=True)])
        out[f"rules_{kind}"] = "ok"
        out[f"stats_{kind}"] = sorted(hist.history)

    # Ranks that disagree get Horovod's TensorFlow error, eager and in a graph, on every rank.
    for mode in ("eager", "graph"):
        def call():
            return hvd.allreduce(tf.ones([1000 if rank == 0 else 1024]), name=f"tf.{mode}")
        try:
            (tf.function(call) if mode == "graph" else call)().numpy()  # errors surface here
            out[f"mismatch_{mode}"] = "no error"
        except tf.errors.OpError as e:
            # Horovod's FailedPreconditionError, eagerly and inside a graph.
            out[f"mismatch_{mode}"] = f"{type(e).__name__}: {e.message}"
    out["after_mismatch"] = np.asarray(hvd.allreduce(tf.ones([2]), name="tf.ok")).tolist()

    # horovod.tensorflow pieces: reducescatter (with Horovod's gradient), graph-mode queries,
    # broadcast_object_fn, in-place broadcast_.
    import cgx.tensorflow as hvd_tf
    v = tf.Variable(tf.range(6, dtype=tf.float32) * (rank + 1))
    with tf.GradientTape() as tape:
        part = hvd_tf.reducescatter(v, op=hvd_tf.Average, name="rs")
        loss = tf.reduce_sum(part * (rank + 1))
    out["rs"] = part.numpy().tolist()
    out["rs_grad"] = tape.gradient(loss, v).numpy().tolist()
    out["size_op"] = int(tf.function(lambda: hvd_tf.size_op())().numpy())
    out["obj"] = hvd_tf.broadcast_object_fn(root_rank=1)({"rank": rank})
    w = tf.Variable([float(rank)] * 2)
    hvd_tf.broadcast_([w], root_rank=1)
    out["bcast_"] = w.numpy().tolist()

    # compression="auto" on the Keras path: a plan is made, the same on every rank.
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(256, activation="tanh"),
                              keras.layers.Dense(64), keras.layers.Dense(3)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01),
                                   compression=hvd.Compression.auto(window=2, adjust_every=4))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=BATCH // 2, epochs=1, shuffle=False, verbose=0)
    out["auto_plan"] = [(r["layer"], r["level"]) for r in opt.compression_plan()]

    # mixed_float16: an overflow on one rank only must skip the step on every rank, not hang.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model(0)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        xo = x[:BATCH * 3].copy()
        if rank == 1:
            xo[0] = 6e4  # float16 overflow in the first batch of rank 1 only
        model.fit(xo, y[:BATCH * 3], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        out["mixed_type"] = type(model.optimizer).__name__
        out["mixed_scale"] = float(model.optimizer.dynamic_scale.numpy())
        out["mixed_iterations"] = int(model.optimizer.iterations.numpy())
        out["mixed_weights"] = [w.tolist() for w in model.get_weights()]
        out["mixed_finite"] = all(np.isfinite(w).all() for w in model.get_weights())
    finally:
        keras.mixed_precision.set_global_policy("float32")

    # Horovod's order, Keras's own class: LossScaleOptimizer(DistributedOptimizer(opt)).
    # An overflow on rank 1 only (float32 squares of 1e20) is skipped on every rank.
    model = _model(0)
    opt = keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    xo = x[:BATCH * 3].copy()
    if rank == 1:
        xo[0] = 1e20
    model.fit(xo, y[:BATCH * 3], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["around_scale"] = float(opt.dynamic_scale.numpy())
    out["around_weights"] = [w.tolist() for w in model.get_weights()]
    return out


def test_keras_reliability_scenarios():
    outs = run_gloo(_keras_scenarios, 2, timeout=300)
    import cgx.tensorflow.keras as hvd
    # Reference: one process, the global batch, the same accumulation; rank 0's weights.
    x, y = _data(BATCH * STEPS * 2)
    xs = np.concatenate([x[r::2] for r in range(2)])
    ys = np.concatenate([y[r::2] for r in range(2)])
    glob_x = np.concatenate([np.concatenate([xs[:len(xs) // 2][k * BATCH:(k + 1) * BATCH],
                                             xs[len(xs) // 2:][k * BATCH:(k + 1) * BATCH]])
                             for k in range(STEPS)])
    glob_y = np.concatenate([np.concatenate([ys[:len(ys) // 2][k * BATCH:(k + 1) * BATCH],
                                             ys[len(ys) // 2:][k * BATCH:(k + 1) * BATCH]])
                             for k in range(STEPS)])
    hvd.init()
    try:
        ref = _train_bpps(hvd, glob_x, glob_y, seed=0, world=1, rank=0)
    finally:
        hvd.shutdown()  # later tests in this process expect no session
    for o in outs:
        for a, b in zip(o["bpps"], ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert o["rules_dict"] == o["rules_list"] == "ok"
        # StatsCallback: the epoch's communication in the logs (History, TensorBoard).
        assert {"cgx_bytes_sent", "cgx_bytes_sent_per_step", "cgx_compression_ratio",
                "cgx_exposed_comm_s_per_step"} <= set(o["stats_dict"]), o["stats_dict"]
        assert o["mixed_type"] == "LossScaleOptimizer"
        assert o["mixed_finite"]
    assert outs[0]["mixed_scale"] == outs[1]["mixed_scale"] < 2.0 ** 15  # lowered together
    assert outs[0]["mixed_weights"] == outs[1]["mixed_weights"]
    assert outs[0]["around_scale"] == outs[1]["around_scale"] < 2.0 ** 15
    assert outs[0]["around_weights"] == outs[1]["around_weights"]
    for r, o in enumerate(outs):
        assert o["rs"] == [1.5 * i for i in range(3 * r, 3 * r + 3)]
        assert o["rs_grad"] == [1.0] * 3 + [2.0] * 3  # allgathered upstream (1, 2), as Horovod
        assert o["size_op"] == 2 and o["obj"] == {"rank": 1} and o["bcast_"] == [1.0, 1.0]
    for o in outs:
        for mode in ("eager", "graph"):
            assert "rank 0 has (1000,), rank 1 has (1024,)" in o[f"mismatch_{mode}"], o
        assert o["mismatch_eager"].startswith("FailedPreconditionError")
        assert o["mismatch_graph"].startswith("FailedPreconditionError")
        assert o["after_mismatch"] == [1.0, 1.0]
    assert outs[0]["auto_plan"] == outs[1]["auto_plan"] and len(outs[0]["auto_plan"]) == 6
    assert any("bit" in level for _, level in outs[0]["auto_plan"])
