"""cgx.tensorflow.keras.DiLoCo in model.fit on real Gloo ranks: H=1 equivalence with
synchronous data parallel, BroadcastGlobalVariablesCallback, save and bit-exact resume.

One 2-rank spawn (TensorFlow costs seconds per process): the resume loads the saved file
into new objects in the same processes (fresh processes: tests/test_diloco_torch.py).
"""

import os

import numpy as np
import pytest

from spawn import run_gloo

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("cgx.tensorflow", exc_type=ImportError)  # before TensorFlow
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.multiproc


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(5)])


def _data(rank, n=32):
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((n, 12)).astype("float32")
    return x, (x[:, :5] * 2).argmax(1)


def _compile(model, opt):
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit(model, rank, epochs, callbacks=()):
    x, y = _data(rank)
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model.get_weights()


def _init():
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import cgx.tensorflow.keras as hvd
    hvd.init()
    return hvd


SCHEDULE = dict(initial_learning_rate=1e-2, decay_steps=3, decay_rate=0.5)


def _streaming(hvd):
    """Adam under a decaying schedule, the outer momentum following it."""
    lr = keras.optimizers.schedules.ExponentialDecay(**SCHEDULE)
    return hvd.DiLoCo(keras.optimizers.Adam(lr), sync_every=4, fragments=2, delay=1,
                      outer_optimizer=hvd.OuterSGD(follow_inner_lr=True))


def _two(rank, world, tmp):
    hvd = _init()
    out = {}
    # H=1, no outer optimizer, exact, two synchronous warm-up steps first; different
    # initial weights, made equal by the broadcast.
    sgd = dict(learning_rate=0.1, momentum=0.9)
    dil = _compile(_model(rank), hvd.DiLoCo(
        keras.optimizers.SGD(**sgd), sync_every=1, outer_optimizer=None, warmup_steps=2,
        compression=hvd.Compression.exact, warmup_compression=hvd.Compression.exact))
    out["h1"] = _fit(dil, rank, 2, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ddp = _compile(_model(0), hvd.DistributedOptimizer(keras.optimizers.SGD(**sgd),
                                                       compression=hvd.Compression.exact))
    out["sync"] = _fit(ddp, rank, 2)
    # Streaming, 4-bit outer gradients: saved after step 4 (fragment 1 in flight).
    model = _compile(_model(0), _streaming(hvd))
    _fit(model, rank, 1)
    model.save(os.path.join(tmp, f"r{rank}.keras"))
    model.save_weights(os.path.join(tmp, f"r{rank}.weights.h5"))
    out["straight"] = _fit(model, rank, 2)
    out["iterations"] = int(model.optimizer.iterations)
    loaded = hvd.load_model(os.path.join(tmp, f"r{rank}.keras"))
    out["loaded"] = (type(loaded.optimizer).__name__, int(loaded.optimizer.iterations),
                     loaded.optimizer is not model.optimizer,
                     loaded.optimizer.get_config()["outer_optimizer"])
    out["momentum_lr"] = list(model.optimizer.loop.state.momentum_lr)
    out["resumed"] = _fit(loaded, rank, 2)
    out["resumed_iterations"] = int(loaded.optimizer.iterations)
    # save_weights/load_weights into a fresh model whose optimizer is built
    fresh = _compile(_model(1), _streaming(hvd))
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(os.path.join(tmp, f"r{rank}.weights.h5"))
    out["weights_resumed"] = _fit(fresh, rank, 2)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("diloco_keras"))
    return tmp, run_gloo(_two, 2, tmp, timeout=300)


def test_h1_in_model_fit_is_synchronous_data_parallel(runs):
    """Equal to float32 rounding, the same on both ranks bit for bit (started from
    different weights: a loop that never synced would fail both)."""
    r0, r1 = runs[1]
    for a, b in zip(r0["h1"], r1["h1"]):
        np.testing.assert_array_equal(a, b)
    for out in (r0, r1):
        for got, want in zip(out["h1"], out["sync"]):
            assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


def test_save_and_resume_mid_round_is_bit_exact(runs):
    """Saved after step 4 with fragment 1's exchange in flight, loaded, 8 more steps."""
    results = runs[1]
    for out in results:
        assert out["loaded"] == ("DiLoCo", 4, True, [0.7, 0.9, True, True])
        assert out["resumed_iterations"] == out["iterations"] == 12
        for a, b, c in zip(out["straight"], out["resumed"], out["weights_resumed"]):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)  # save_weights carries the state too
    assert not all(np.array_equal(a, b) for a, b in zip(results[0]["straight"],
                                                       results[1]["straight"]))


def test_outer_momentum_follows_the_schedules_learning_rate(runs):
    """``OuterSGD(follow_inner_lr=True)`` under an ``ExponentialDecay``: the loop records,
    per variable, the learning rate of the step its fragment last landed at (fragment 0
    syncs at steps 2, 6, 10 and lands a step later, fragment 1 at 4, 8, 12; after 12 steps
    their last landings are steps 11 and 9, taken at the schedule's values of iterations
    10 and 8)."""
    lr = keras.optimizers.schedules.ExponentialDecay(**SCHEDULE)
    for out in runs[1]:
        got = out["momentum_lr"]
        assert all(x is not None for x in got), got
        want = {float(lr(s)) for s in (8, 10)}
        assert {round(x, 9) for x in got} == {round(x, 9) for x in want}, (got, want)
