"""cgx.tensorflow.keras: DistributedOptimizer in model.fit, callbacks, accumulation, saving.

One 2-rank spawn runs every multi-rank check (TensorFlow and Keras cost
seconds per process); configuration, serialization and validation run here.
"""

import json
import os
import pickle

import numpy as np
import pytest

from spawn import run_gloo

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads: no banner
# cgx.tensorflow first: it orders the native libraries (Triton before TensorFlow)
pytest.importorskip("cgx.tensorflow", exc_type=ImportError)
import tensorflow as tf  # noqa: E402
keras = pytest.importorskip("keras")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.multiproc

WARMUP_STEPS = 4  # batches per epoch in the learning-rate runs


def _mlp(seed, hidden=64):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(10)])


def _compile(model, opt):
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _RecordLR(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def _apply_step(opt, v, graph):
    def step(g):
        opt.apply([g], [v])

    return tf.function(step) if graph else step


def _heavy_tailed(seed):
    """A gradient-like [64, 96] float32 array, a few entries far above the typical one."""
    rng = np.random.default_rng(300 + seed)
    return (rng.standard_normal((64, 96)) * np.exp(1.5 * rng.standard_normal((64, 96)))
            * 0.01).astype("float32")


def _keras_world(rank, world, tmp):
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import cgx.tensorflow.keras as hvd
    from cgx.config import Config
    from sklearn.datasets import load_digits

    hvd.init(Config())  # defaults: 4-bit quantization of large layers
    out = {}
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype("float32")
    shard = slice(rank, 1500, world)  # each rank trains on its half; the rest validates
    val = (X[1500:][rank::world], y[1500:][rank::world])

    # -- model.fit on digits: different initial weights per rank, made equal by the
    # broadcast; metrics averaged; the best model saved by rank 0 only
    model = _compile(_mlp(seed=rank), hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.05 * world, momentum=0.9)))
    best = os.path.join(tmp, f"best_r{rank}.keras")
    hist = model.fit(X[shard], y[shard], batch_size=32, epochs=4, validation_data=val,
                     verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback(),
                                           hvd.callbacks.BestModelCheckpoint(
                                               monitor="val_loss", filepath=best)])
    out["history"] = hist.history
    out["weights"] = model.get_weights()
    out["iterations"] = int(model.optimizer.iterations)
    out["best_saved"] = os.path.exists(best)
    (plan,) = model.optimizer._exchange._plans.values()
    out["specs"] = {n: (s.bits if s else None) for n, s in zip(plan.names, plan.specs)}

    # -- save on rank 0, load everywhere, keep training
    path = os.path.join(tmp, "model.keras")
    plain = os.path.join(tmp, "plain.keras")
    if rank == 0:
        model.save(path)
        _compile(_mlp(seed=0, hidden=8), keras.optimizers.SGD(0.1)).save(plain)
    hvd.barrier()
    loaded = hvd.load_model(path)
    out["loaded"] = (type(loaded.optimizer).__name__, int(loaded.optimizer.iterations),
                     all(np.array_equal(a, b)
                         for a, b in zip(loaded.get_weights(), out["weights"])))
    loaded.fit(X[shard], y[shard], batch_size=64, epochs=1, verbose=0)
    out["loaded_weights"] = loaded.get_weights()
    wrapped = hvd.load_model(plain, compression=hvd.Compression.fp16)
    out["wrapped"] = (type(wrapped.optimizer).__name__,
                      repr(wrapped.optimizer._compression))
    wrapped.fit(X[shard][:64], y[shard][:64], batch_size=32, epochs=1, verbose=0)
    out["wrapped_weights"] = wrapped.get_weights()

    # -- learning-rate callbacks (the recorder runs after them)
    def lrs(callbacks, epochs=3, lr=0.3):
        rec = _RecordLR()
        m = _compile(_mlp(seed=0, hidden=8), hvd.DistributedOptimizer(
            keras.optimizers.SGD(lr, momentum=0.9)))
        m.fit(X[:32 * WARMUP_STEPS], y[:32 * WARMUP_STEPS], batch_size=32, epochs=epochs,
              verbose=0, callbacks=[*callbacks, rec])
        return rec.lrs

    out["warmup"] = lrs([hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2,
                                                                  warmup_epochs=2)])
    out["schedule"] = lrs([
        hvd.callbacks.LearningRateScheduleCallback(0.2, multiplier=0.5, start_epoch=1,
                                                   end_epoch=2),
        hvd.callbacks.LearningRateScheduleCallback(0.2, multiplier=lambda e: 0.1 * e,
                                                   start_epoch=2, staircase=False)])

    # -- backward_passes_per_step: local sums, one exchange per 2 batches
    for key, average in (("bpps", False), ("bpps_avg", True)):
        v = tf.Variable(tf.zeros([4, 300]))
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                       average_aggregated_gradients=average,
                                       compression=hvd.Compression.exact)
        opt.build([v])
        step = _apply_step(opt, v, graph=not average)  # one in a tf.function, one eager
        seen = []
        for g in (tf.fill([4, 300], rank + 1.0), tf.fill([4, 300], 10.0 * (rank + 1))):
            step(g)
            seen.append((float(v.numpy()[0, 0]), int(opt.iterations)))
        out[key] = seen

    # -- rotate=True reaches the Keras exchange: SGD(1.0) from zero leaves minus the
    # average gradient behind
    for rotate in (False, True):
        v = tf.Variable(tf.zeros([64, 96]))
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=(
            hvd.Compression.quantize(bits=3, bucket_size=512, rounding="nearest",
                                     rotate=rotate)))
        opt.build([v])
        opt.apply([tf.constant(_heavy_tailed(rank))], [v])
        out[("rotate", rotate)] = -v.numpy()

    # -- MetricAverageCallback refuses ranks that report different metrics
    cb = hvd.callbacks.MetricAverageCallback()
    cb.set_model(model)
    try:
        cb.on_epoch_end(0, {"loss": 1.0} if rank == 0 else {"loss": 1.0, "extra": 2.0})
        out["mismatch"] = "no error"
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def test_keras_fit_callbacks_and_accumulation_on_two_ranks(tmp_path):
    r0, r1 = run_gloo(_keras_world, 2, str(tmp_path), timeout=300)
    for out in (r0, r1):
        hist = out["history"]
        assert hist["loss"][-1] < hist["loss"][0], hist["loss"]
        assert hist["val_accuracy"][-1] > 0.85, hist["val_accuracy"]
        assert out["iterations"] == 4 * 24  # 750 samples per rank, batches of 32
        assert out["specs"] == {"sequential/dense/kernel": 4, "sequential/dense/bias": None,
                                "sequential/dense_1/kernel": None,
                                "sequential/dense_1/bias": None}
        assert out["loaded"] == ("DistributedOptimizer", 96, True)
        assert out["wrapped"] == ("DistributedOptimizer", "<class "
                                  "'cgx.tensorflow.compression.FP16Compressor'>")
        assert "ranks report different metrics" in out["mismatch"]
    # weights identical on both ranks after training (compressed exchange included)
    for key in ("weights", "loaded_weights", "wrapped_weights"):
        for a, b in zip(r0[key], r1[key]):
            np.testing.assert_array_equal(a, b, err_msg=key)
    assert r0["history"] == r1["history"], "averaged metrics differ between ranks"
    assert r0["best_saved"] and not r1["best_saved"]

    # warmup from 0.2 / 2 to 0.2 over 2 epochs of 4 batches, per batch; then untouched
    want = [0.2 / 2 * ((e + (b + 1) / WARMUP_STEPS) * (2 - 1) / 2 + 1)
            for e in range(2) for b in range(WARMUP_STEPS)] + [0.2] * WARMUP_STEPS
    np.testing.assert_allclose(r0["warmup"], want, rtol=1e-6)
    # epoch 0 untouched (0.3); epoch 1 constant 0.2 * 0.5; epoch 2 0.2 * 0.1 * (2 + b / 4)
    want = [0.3] * WARMUP_STEPS + [0.1] * WARMUP_STEPS + \
        [0.2 * 0.1 * (2 + b / WARMUP_STEPS) for b in range(WARMUP_STEPS)]
    np.testing.assert_allclose(r0["schedule"], want, rtol=1e-6)

    # gradients 1|2 then 10|20 on ranks 0|1: nothing moves on the first pass; the
    # second applies the average of the sums (16.5), or of the means (8.25)
    for out in (r0, r1):
        assert out["bpps"] == [(0.0, 1), (-16.5, 2)]
        assert out["bpps_avg"] == [(0.0, 1), (-8.25, 2)]

    # rotation at 3 bits on heavy-tailed gradients: the same average on both ranks, off
    # the true one by less than half the unrotated exchange's error
    mean = (_heavy_tailed(0) + _heavy_tailed(1)) / 2
    np.testing.assert_array_equal(r0[("rotate", True)], r1[("rotate", True)])
    err = {r: np.linalg.norm(r0[("rotate", r)] - mean) for r in (False, True)}
    assert 0 < err[True] < 0.5 * err[False], err


# -- single process: configuration, serialization, validation ---------------------------

@pytest.fixture
def hvd():
    import cgx.tensorflow.keras as hvd
    from cgx.config import Config
    hvd.init(Config())
    yield hvd
    hvd.shutdown()


@pytest.mark.parametrize("compression", [
    "none", "exact", "fp16_predivide", "quantize_ef", "topk", "powersgd"])
def test_optimizer_config_round_trip(compression):
    import cgx.tensorflow.keras as hvd
    comp = {"none": hvd.Compression.none, "exact": hvd.Compression.exact,
            "fp16_predivide": hvd.Compression.fp16(predivide=2.0),
            "quantize_ef": hvd.Compression.quantize(bits=8, rounding="nearest",
                                                    error_feedback=True),
            "topk": hvd.Compression.topk(0.05), "powersgd": hvd.Compression.powersgd(rank=2)
            }[compression]
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.003), compression=comp,
                                   backward_passes_per_step=3, op=hvd.Sum,
                                   rules={"layers": [{"pattern": "*bias", "exclude": True}]})
    config = opt.get_config()
    json.dumps(config)  # Keras writes it as JSON
    clone = hvd.DistributedOptimizer.from_config(config)
    assert repr(clone._compression) == repr(comp)
    assert clone.get_config() == config
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    assert clone.learning_rate.numpy() == pytest.approx(0.003)
    # Keras' own (de)serialization finds the registered class
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert type(again) is hvd.DistributedOptimizer and again.get_config() == config


def test_optimizer_pickles_and_delegates():
    import cgx.tensorflow.keras as hvd
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
                                   name="dist", compression=hvd.Compression.quantize(bits=2))
    clone = pickle.loads(pickle.dumps(opt))
    assert type(clone) is hvd.DistributedOptimizer
    assert clone.get_config() == opt.get_config()
    # hyperparameters of the wrapped optimizer read through the wrapper
    assert opt.momentum == 0.9 and opt.nesterov is True
    opt.learning_rate = 0.5
    assert float(opt.inner_optimizer.learning_rate.numpy()) == 0.5
    with pytest.raises(AttributeError, match="no attribute '_private'"):
        opt._private

    import cgx.tensorflow
    # horovod.tensorflow's DistributedOptimizer: the Keras one, under its own signature.
    wrapped = cgx.tensorflow.DistributedOptimizer(keras.optimizers.SGD(0.1), None, False)
    assert isinstance(wrapped, hvd.DistributedOptimizer)

    class Subclassed(hvd.DistributedOptimizer):  # a real class: subclassing works
        pass

    assert isinstance(Subclassed(keras.optimizers.SGD(0.1)), keras.optimizers.Optimizer)


def test_user_compressor_is_not_saved_silently():
    import cgx.tensorflow.keras as hvd

    class Mine:
        @staticmethod
        def compress(t):
            return t, None

        @staticmethod
        def decompress(t, ctx):
            return t

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=Mine)
    with pytest.warns(UserWarning, match="cannot be saved"):
        config = opt.get_config()
    assert config["compression"] is None
    assert hvd.DistributedOptimizer.from_config(config)._compression is hvd.Compression.none


def test_validation_errors(hvd):
    from cgx.tensorflow.keras._serialization import compression_from_config
    sgd = keras.optimizers.SGD(0.1)
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(hvd.DistributedOptimizer(sgd))
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(TypeError, match="average_aggregated_gradients must be True or False"):
        hvd.DistributedOptimizer(sgd, average_aggregated_gradients=1)
    with pytest.raises(ValueError, match="op must be Average or Sum"):
        hvd.DistributedOptimizer(sgd, op=hvd.Max)
    with pytest.raises(ValueError, match="applies to op=Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=4.0)
    with pytest.raises(TypeError, match="compression must be"):
        hvd.DistributedOptimizer(sgd, compression="fp16")
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be a ProcessSet"):
        hvd.DistributedOptimizer(sgd, process_set=object())
    opt = hvd.DistributedOptimizer(sgd)
    with pytest.raises(ValueError, match="needs a built optimizer"):
        opt.apply([tf.ones([2])])
    with pytest.raises(ValueError, match="1 gradients for 2 variables"):
        opt.apply([tf.ones([2])], [tf.Variable(tf.ones([2])), tf.Variable(tf.ones([2]))])
    with pytest.raises(ValueError, match="unknown compression type"):
        compression_from_config({"type": "zip"})
    with pytest.raises(ValueError, match="'type' key"):
        compression_from_config(["fp16"])
    cbs = hvd.callbacks
    with pytest.raises(ValueError, match="root_rank must be an int >= 0"):
        cbs.BroadcastGlobalVariablesCallback(-1)
    with pytest.raises(ValueError, match="initial_lr must be a number > 0"):
        cbs.LearningRateScheduleCallback(None, 0.5)
    with pytest.raises(TypeError, match="multiplier must be a number or a function"):
        cbs.LearningRateScheduleCallback(0.1, "0.5")
    with pytest.raises(ValueError, match="end_epoch must be an int >= 3"):
        cbs.LearningRateScheduleCallback(0.1, 0.5, start_epoch=2, end_epoch=2)
    with pytest.raises(ValueError, match="steps_per_epoch must be an int >= 1"):
        cbs.LearningRateScheduleCallback(0.1, 0.5, steps_per_epoch=0)
    with pytest.raises(ValueError, match="warmup_epochs must be an int >= 1"):
        cbs.LearningRateWarmupCallback(0.1, warmup_epochs=0)
    with pytest.raises(ValueError, match="needs filepath="):
        cbs.BestModelCheckpoint(monitor="val_loss")
    warmup = cbs.LearningRateWarmupCallback(0.1)
    warmup.set_params({"epochs": 3})
    with pytest.raises(ValueError, match="pass steps_per_epoch="):
        warmup.on_train_begin()


def test_momentum_correction_rescales_velocity(hvd):
    model = _compile(_mlp(seed=0, hidden=8), hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9)))
    model.optimizer.build(model.trainable_variables)
    velocity = model.optimizer.inner_optimizer.momentums
    for v in velocity:
        v.assign(tf.ones_like(v))
    for correction, want in ((False, 1.0), (True, 0.5)):
        model.optimizer.learning_rate = 0.1
        cb = hvd.callbacks.LearningRateScheduleCallback(0.1, multiplier=0.5,
                                                        momentum_correction=correction)
        cb.set_model(model)
        cb.on_train_begin()
        cb.on_epoch_begin(0)
        cb.on_train_batch_begin(0)
        assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
        assert all(np.allclose(v.numpy(), want) for v in velocity)


def test_policies_keep_every_setting_through_get_config(hvd):
    """A Keras reload used to lose auto's objective, trials and model plans, and saved
    Compression.planned() as None: the rebuilt optimizer holds the same settings."""
    policies = (hvd.Compression.auto(objective="time", trial_steps=4, model_plans=1,
                                     recheck_every=50, trial_runoffs=0, alpha=1.5),
                hvd.Compression.planned(bits=2, calibrate_steps=3, trials=False))
    for comp in policies:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=comp)
        config = json.loads(json.dumps(opt.get_config()))
        back = hvd.DistributedOptimizer.from_config(config)._compression
        assert type(back) is type(comp) and vars(back) == vars(comp)
