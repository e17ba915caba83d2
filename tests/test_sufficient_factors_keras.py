"""Sufficient factors on the Keras path: the Dense layers' averaged gradients rebuilt from
all-gathered factors equal the true average of every rank's gradient, on 2 and 3 real
ranks: model.fit, a compiled custom step with backward_passes_per_step=2, a frozen
layer, a layer called twice, ranks with different batch sizes, and eagerly; and a kernel
also used outside its layer (tied, read by another layer, an extra loss term) is
averaged whole, never passed through with one rank's share of the other uses."""

import os

import numpy as np
import pytest

from spawn import run_gloo

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("cgx.tensorflow", exc_type=ImportError)
import tensorflow as tf  # noqa: E402
keras = pytest.importorskip("keras")


def _sequential():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(3)])


def _shared():
    """A functional model calling one Dense twice, with a frozen Dense between."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((32,))
    twice = keras.layers.Dense(32, activation="tanh", name="twice")
    frozen = keras.layers.Dense(32, name="frozen")
    frozen.trainable = False
    h = twice(frozen(twice(inp)))
    out = keras.layers.Dense(48, name="head")(h)
    return keras.Model(inp, keras.layers.Dense(3, name="logits")(out))


def _data(rank, rows, step=0):
    g = np.random.default_rng(1000 * step + rank)
    return g.normal(size=(rows, 32)).astype("float32"), g.integers(0, 3, rows)


def _loss(model, x, y):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        y, model(x, training=True), from_logits=True))


def _average_grads(build, batches, loss_fn=None, weights=None):
    """The true averaged gradient: every rank's batch through a fresh copy (holding
    ``weights`` when given), averaged."""
    model = build()
    for v, w in zip(model.trainable_variables, weights or []):
        v.assign(w)
    total = None
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = (loss_fn or _loss)(model, x, y)
        g = [t.numpy() for t in tape.gradient(loss, model.trainable_variables)]
        total = g if total is None else [a + b for a, b in zip(total, g)]
    return [t / len(batches) for t in total]


def _summed(grad_lists):
    """Element-wise sum of several lists of gradients."""
    return [sum(parts) for parts in zip(*grad_lists)]


def _applied(before, after, lr):
    return [(b - a) / lr for b, a in zip(before, after)]


def _world(rank, world):
    import cgx.tensorflow.keras as hvd
    hvd.init()
    out = {}
    lr = 0.5

    # 1. model.fit, 4 rows per rank: the two 64-wide layers go as factors, the 64 x 3
    #    head plainly (4 x P x 67 > 192), exactly here.
    model = _sequential()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), compression=hvd.Compression.exact,
                                   sufficient_factors=model)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    before = [v.numpy() for v in model.trainable_variables]
    x, y = _data(rank, 4)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    out["fit"] = _applied(before, [v.numpy() for v in model.trainable_variables], lr)
    out["fit_expected"] = _average_grads(_sequential, [_data(r, 4) for r in range(world)])
    out["fit_used"] = opt.sufficient_factors_used()
    out["fit_equal_across_ranks"] = [v.numpy() for v in model.trainable_variables]
    # Every Dense gradient came averaged out of backward: the optimizer's own exchange
    # reduced nothing again.
    out["fit_reduced_again"] = [n for key in opt._exchange._plans for n in key[0]]

    # 2. A compiled step, backward_passes_per_step=2, rank r with 3 + r rows (padding),
    #    a layer called twice and a frozen one.
    for eager in (False, True):
        model = _shared()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr),
                                       compression=hvd.Compression.exact,
                                       backward_passes_per_step=2, sufficient_factors=model)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = _loss(model, x, y)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        run = step if eager else tf.function(step, reduce_retracing=True)
        before = [v.numpy() for v in model.trainable_variables]
        for p in range(2):
            x, y = _data(rank, 3 + rank, step=p + 1)
            run(tf.constant(x), tf.constant(y))
        key = "eager" if eager else "graph"
        out[key] = _applied(before, [v.numpy() for v in model.trainable_variables], lr)
        out[key + "_used"] = opt.sufficient_factors_used()
        out[key + "_frozen_kernel"] = model.get_layer("frozen").kernel.numpy()
    # the sum of the two passes' averaged gradients
    out["bpps_expected"] = _summed([_average_grads(_shared, [_data(r, 3 + r, step=p + 1)
                                                            for r in range(world)])
                                    for p in range(2)])
    out["frozen_kernel"] = _shared().get_layer("frozen").kernel.numpy()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_rebuilt_gradients_equal_the_average(world):
    results = run_gloo(_world, world, timeout=300)
    for r in results:
        for got, want in zip(r["fit"], r["fit_expected"]):
            np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
        assert len(r["fit"]) == len(r["fit_expected"]) == 6
        assert r["fit_reduced_again"] == []
        for key in ("graph", "eager"):
            assert len(r[key]) == len(r["bpps_expected"]) == 6  # twice, head, logits: 2 each
            for got, want in zip(r[key], r["bpps_expected"]):
                np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
            np.testing.assert_array_equal(r[key + "_frozen_kernel"], r["frozen_kernel"])
        # Poseidon's rule, decided alike on every rank: 4 x P x (32 + 64) < 32 x 64 and
        # 4 x P x 128 < 64 x 64 go as factors; 4 x P x 67 >= 64 x 3 does not.
        used = r["fit_used"]
        assert sorted(v for v in used.values()) == [False, True, True], used
        # 2 passes of 3..5 rows: "twice" (32 x 32) as factors only while
        # K x P x 64 < 1024; the 32 x 48 head while K x P x 80 < 1536; logits never.
        for key in ("graph", "eager"):
            k = 3 + world - 1
            want = {"twice": k * world * 64 < 1024, "head": k * world * 80 < 1536,
                    "logits": False}
            assert r[key + "_used"] == want, r[key + "_used"]
    for a, b in zip(results[0]["fit_equal_across_ranks"], results[-1]["fit_equal_across_ranks"]):
        np.testing.assert_array_equal(a, b)  # the same rebuilt average: identical replicas


class _TiedHead(keras.layers.Layer):
    """Outputs through the transposed kernel of the Dense layer it holds (a tied head)."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, h):
        return tf.matmul(h, self.dense.kernel, transpose_b=True)


def _tied():
    """A 32 -> 64 Dense whose kernel a head holding the layer uses again, transposed."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((32,))
    embed = keras.layers.Dense(64, activation="tanh", name="embed")
    h = _TiedHead(embed, name="tied")(embed(inp))
    return keras.Model(inp, keras.layers.Dense(3, name="logits")(h))


def _borrowed():
    """A 32 x 32 Dense whose kernel a Lambda multiplies by again, reaching it through a
    closure: nothing in the model shows it."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((32,))
    mid = keras.layers.Dense(32, activation="tanh", name="mid")
    again = keras.layers.Lambda(lambda t: tf.matmul(t, mid.kernel), name="again")(mid(inp))
    return keras.Model(inp, keras.layers.Dense(3, name="logits")(again))


def _extra_loss(model, x, y):
    """The loss plus a term of the first kernel on this rank's rows (a custom step's)."""
    kernel = model.layers[0].kernel
    return _loss(model, x, y) + 0.1 * tf.reduce_mean(tf.square(tf.matmul(x, kernel)))


def _shared_kernels(rank, world):
    import cgx.tensorflow.keras as hvd
    hvd.init()
    out, lr = {}, 0.5
    # model.fit, two steps each: the second one after the exchange learned about the kernel.
    for case, build in (("tied", _tied), ("borrowed", _borrowed)):
        model = build()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr),
                                       compression=hvd.Compression.exact,
                                       sufficient_factors=model)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        for step in (1, 2):
            before = [v.numpy() for v in model.trainable_variables]
            x, y = _data(rank, 4, step=step)
            model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
            after = [v.numpy() for v in model.trainable_variables]
            out[f"{case}{step}"] = _applied(before, after, lr)
            out[f"{case}{step}_expected"] = _average_grads(
                build, [_data(r, 4, step=step) for r in range(world)], weights=before)
        out[case + "_used"] = opt.sufficient_factors_used()
        out[case + "_weights"] = after
    # A custom step whose loss has a term of its own on the first kernel: compiled with
    # backward_passes_per_step=2, and eagerly with op=Sum.
    for key, eager, op, passes in (("extra", False, hvd.Average, 2),
                                   ("extra_sum", True, hvd.Sum, 1)):
        model = _sequential()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr),
                                       compression=hvd.Compression.exact, op=op,
                                       backward_passes_per_step=passes,
                                       sufficient_factors=model)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = _extra_loss(model, x, y)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        run = step if eager else tf.function(step)
        before = [v.numpy() for v in model.trainable_variables]
        grads = []
        for p in range(passes):
            x, y = _data(rank, 4, step=3 + p)
            run(tf.constant(x), tf.constant(y))
            grads.append(_average_grads(_sequential, [_data(r, 4, step=3 + p)
                                                      for r in range(world)],
                                        loss_fn=_extra_loss))
        expected = _summed(grads)
        after = [v.numpy() for v in model.trainable_variables]
        out[key] = _applied(before, after, lr)
        out[key + "_expected"] = [g * (world if op is hvd.Sum else 1) for g in expected]
        used = opt.sufficient_factors_used()
        out[key + "_used"] = [used.get(layer.name) for layer in model.layers]
        out[key + "_weights"] = after
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_a_kernel_used_outside_its_layer_is_averaged_whole(world):
    results = run_gloo(_shared_kernels, world, timeout=300)
    for r in results:
        for key in ("tied1", "tied2", "borrowed1", "borrowed2", "extra", "extra_sum"):
            assert len(r[key]) == len(r[key + "_expected"]) > 0
            for got, want in zip(r[key], r[key + "_expected"]):
                np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6, err_msg=key)
        # The tied layer is never routed: the head holding it shows the kernel is shared.
        assert "embed" not in r["tied_used"] and r["tied_used"]["logits"] is False
        # The borrowed and the extra-loss kernels sent factors in their first step, were
        # found not to be the whole gradient, and go the ordinary way since.
        assert r["borrowed_used"] == {"mid": False, "logits": False}
        for key in ("extra_used", "extra_sum_used"):  # 32 x 64, 64 x 64, 64 x 3
            assert r[key] == [False, True, False], r[key]
    for key in ("tied_weights", "borrowed_weights", "extra_weights", "extra_sum_weights"):
        for a, b in zip(results[0][key], results[-1][key]):
            np.testing.assert_array_equal(a, b, err_msg=key)  # identical replicas


def _loss_scaled(rank, world):
    import cgx.tensorflow.keras as hvd
    hvd.init()
    keras.config.set_dtype_policy("mixed_float16")
    g = np.random.default_rng(rank)
    x, y = g.normal(size=(8, 32)).astype("float32"), g.integers(0, 3, 8)
    out = {}
    for factors in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(3, dtype="float32")])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                       compression=hvd.Compression.exact,
                                       sufficient_factors=model if factors else None)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        out[factors] = model.get_weights()
    used = model.optimizer.inner_optimizer.sufficient_factors_used()
    out["used"] = [used[layer.name] for layer in model.layers]
    return out


@pytest.mark.multiproc
def test_a_loss_scaled_gradient_still_counts_as_the_factors():
    """Under mixed precision the optimizer receives the rebuilt average divided by the loss
    scale: the same scalar on every rank, so the factors stay in use."""
    results = run_gloo(_loss_scaled, 2, timeout=300)
    for r in results:
        assert r["used"] == [True, True, False]
        for a, b in zip(r[False], r[True]):  # float16 products
            np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)
    for a, b in zip(results[0][True], results[1][True]):
        np.testing.assert_array_equal(a, b)


def test_sufficient_factors_need_a_model_and_a_fixed_compression():
    import cgx.tensorflow.keras as hvd
    with pytest.raises(TypeError, match="Keras model"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sufficient_factors=[1, 2])
    model = _sequential()
    for policy in (hvd.Compression.auto(), hvd.Compression.planned()):
        with pytest.raises(ValueError, match="fixed"):
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sufficient_factors=model,
                                     compression=policy)


def test_exact_goes_with_factors_under_cgx_compression_auto(monkeypatch):
    """Under CGX_COMPRESSION=auto the default is a per-model plan (refused beside factors),
    Compression.exact is not (it shares the default's compressor kind)."""
    import cgx.tensorflow.keras as hvd
    from cgx import runtime
    from cgx.config import CompressionMode, Config
    from cgx.tensorflow.keras.sufficient_factors import check_compression
    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "config", lambda: Config(compression=CompressionMode.AUTO))
    check_compression(hvd.Compression.exact)
    with pytest.raises(ValueError, match="fixed"):
        check_compression(hvd.Compression.none)


def test_which_dense_layers_are_routed():
    """Plain Dense layers only: not a subclass, not one with LoRA, not one whose weights
    carry a regularizer (its loss term adds to the kernel's gradient)."""
    import cgx.tensorflow.keras as hvd
    from cgx.config import Config
    from cgx.tensorflow.keras.sufficient_factors import routable

    class MyDense(keras.layers.Dense):
        pass

    plain, sub, lora = keras.layers.Dense(4), MyDense(4), keras.layers.Dense(4)
    reg = keras.layers.Dense(4, kernel_regularizer="l2")
    model = keras.Sequential([keras.Input((3,)), plain, sub, lora, reg])
    lora.enable_lora(2)
    assert routable(plain) and routable(reg)
    assert not routable(sub) and not routable(lora)
    hvd.init(Config())
    try:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sufficient_factors=model)
        assert opt._factors.routes(plain)
        assert not any(opt._factors.routes(x) for x in (sub, lora, reg))
    finally:
        hvd.shutdown()


def _mixed(rank, world, tmp):
    import cgx.tensorflow.keras as hvd
    hvd.init()
    keras.config.set_dtype_policy("mixed_float16")
    x = np.random.default_rng(0).normal(size=(8, 5, 32)).astype("float32")  # a sequence
    y = np.random.default_rng(1).integers(0, 3, (8, 5))
    weights, kinds = {}, {}
    for factors in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5, 32)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(3, dtype="float32")])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                       compression=hvd.Compression.exact,
                                       sufficient_factors=model if factors else None)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        weights[factors] = model.get_weights()
        kinds[factors] = type(model.optimizer).__name__
    path = os.path.join(tmp, "mixed.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    inner = type(loaded.optimizer.inner_optimizer).__name__
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return {"weights": weights, "kinds": kinds, "loaded": (type(loaded.optimizer).__name__,
                                                           inner)}


@pytest.mark.multiproc
def test_mixed_precision_sequences_and_load_model(tmp_path):
    (r,) = run_gloo(_mixed, 1, str(tmp_path), timeout=300)
    assert r["kinds"] == {False: "LossScaleOptimizer", True: "LossScaleOptimizer"}
    for a, b in zip(r["weights"][False], r["weights"][True]):  # float16 products
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)
    # A saved loss-scaled DistributedOptimizer loads as it was (it used to be wrapped again,
    # which raised "already a DistributedOptimizer").
    assert r["loaded"] == ("LossScaleOptimizer", "DistributedOptimizer")
