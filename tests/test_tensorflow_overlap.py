"""The TensorFlow exchange inside tf.function: one start op per fusion bucket, chained in
backward's order, one finish op; the same gradients as the eager (one call) exchange.
Compression.planned() plans the TensorFlow timeline as it does torch's."""

import os

import pytest

from spawn import run_gloo

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("cgx.tensorflow", exc_type=ImportError)
import tensorflow as tf  # noqa: E402
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.multiproc

FUSION_MB = "0.01"  # ~10 KB buckets: every weight of the model below gets its own


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])


def _grads_fn(model, compression, graph, **groups):
    import cgx.tensorflow as hvd

    def grads(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression, **groups)
        return tape.gradient(loss, model.trainable_variables)

    return tf.function(grads) if graph else grads


def _world(rank, world):
    os.environ["CGX_FUSION_BUFFER_SIZE_MB"] = FUSION_MB
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import cgx.tensorflow as hvd
    from cgx.exchange import ready_order_buckets
    hvd.init()
    model = _model()
    g = tf.random.Generator.from_seed(rank)
    x, y = g.normal((16, 64)), g.uniform((16,), 0, 10, dtype=tf.int64)
    graph_fn = _grads_fn(model, hvd.Compression.exact, True)
    graph = [t.numpy() for t in graph_fn(x, y)]
    eager = [t.numpy() for t in _grads_fn(model, hvd.Compression.exact, False)(x, y)]
    ops = [op.name for op in graph_fn.get_concrete_function(x, y).graph.get_operations()]
    starts = sorted(n for n in ops if ".start" in n and n.startswith("cgx_"))
    sizes = [4 * int(tf.size(v)) for v in model.trainable_variables]
    buckets = ready_order_buckets(sizes, int(float(FUSION_MB) * (1 << 20)))
    # Horovod's num_groups and groups decide the buckets, in graph mode and eagerly.
    grouped = {}
    first_two = model.trainable_variables[:2]
    for key, kw in (("num_groups", {"num_groups": 2}), ("groups", {"groups": [first_two]}),
                    ("groups_int", {"groups": 3})):
        fn = _grads_fn(model, hvd.Compression.exact, True, **kw)
        out = [t.numpy() for t in fn(x, y)]
        eager_out = [t.numpy() for t in _grads_fn(model, hvd.Compression.exact, False, **kw)(x, y)]
        names = [op.name for op in fn.get_concrete_function(x, y).graph.get_operations()]
        grouped[key] = {"starts": sum(".start" in n and n.startswith("cgx_") for n in names),
                        "same": all((u == v).all() for u, v in zip(out, graph)) and
                        all((u == v).all() for u, v in zip(eager_out, graph))}

    # Compression.planned on the TensorFlow path: traced, planned alike on every rank.
    planned_model = _model()
    comp = hvd.Compression.planned(calibrate_steps=2, assume_gbit=0.001, replan_every=2,
                                   trials=False)  # the planner's plan and its drift checks
    fn = _grads_fn(planned_model, comp, True)
    for _ in range(6):
        fn(x, y)
    from cgx.tensorflow.gradients import _exchanges
    ex = [e for e in _exchanges.values() if "Planned" in repr(e.compression)][0]
    (plan,) = ex._plans.values()
    return {"graph": graph, "eager": eager, "starts": starts, "buckets": buckets,
            "grouped": grouped,
            "levels": [r["level"] for r in ex.compression_plan()],
            "checks": [(c.step, c.replanned) for c in plan.planned.checks],
            "first_ready": [min(r) if r else None for r in plan.planned._ready]}


def test_buckets_start_in_graph_and_match_the_eager_exchange():
    a, b = run_gloo(_world, 2, timeout=300)
    # 3 kernels + 3 biases; 10 KB buckets: the last bias and kernel share the first bucket
    assert len(a["buckets"]) > 3
    assert len(a["starts"]) == len(a["buckets"])
    for r in (a, b):
        assert all((u == v).all() for u, v in zip(r["graph"], r["eager"]))
    assert all((u == v).all() for u, v in zip(a["graph"], b["graph"]))
    # num_groups=2: two buckets; groups=[first two variables]: they and the rest;
    # groups=3 is Horovod's integer spelling of num_groups
    for r in (a, b):
        assert {k: v["starts"] for k, v in r["grouped"].items()} == \
            {"num_groups": 2, "groups": 2, "groups_int": 3}
        assert all(v["same"] for v in r["grouped"].values())
    # at 1 Mbit/s the planner compresses the kernels; the rules keep the biases exact
    assert a["levels"] == b["levels"]
    assert [lv != "exact" for lv in a["levels"]] == [True, False] * 3
    assert a["checks"] == b["checks"] and [c[0] for c in a["checks"]] == [4]
    # ready times were traced per bucket: the first bucket's gradients are ready at 0
    assert a["first_ready"][-1] == 0.0 and all(t is not None for t in a["first_ready"])


def _reuse(rank, world):
    import cgx.tensorflow as hvd
    hvd.init()
    v = tf.Variable(tf.zeros([1 << 18]))  # 1 MB: a buffer of its own

    @tf.function
    def exchange(scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * scale * float(rank + 1))
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.exact)
        return tape.gradient(loss, [v])[0]

    ex = lambda s: exchange(tf.constant(s))  # noqa: E731
    ex(1.0)
    from cgx.tensorflow.gradients import _exchanges
    (e,) = _exchanges.values()
    # Results dropped at once: the same torch buffer serves every step.
    ptrs = []
    for s in (2.0, 3.0):
        float(ex(s)[0])
        ptrs += [t.data_ptr() for t in e._buffers._slots.values()]
    # Results kept: step 4's exchange must not write into the memory step 3's result uses.
    kept = ex(4.0)
    again = ex(5.0)
    return {"reused": len(set(ptrs)) == 1, "kept": float(kept[0]), "again": float(again[0]),
            "kept_all": bool(tf.reduce_all(kept == kept[0]))}


def test_work_buffers_are_reused_only_when_nothing_holds_them():
    for r in run_gloo(_reuse, 2):
        assert r["reused"]
        # gradient of sum(v * s * (rank + 1)), averaged over ranks 0 and 1: s * 1.5
        assert r["kept"] == 4.0 * 1.5 and r["kept_all"]
        assert r["again"] == 5.0 * 1.5
