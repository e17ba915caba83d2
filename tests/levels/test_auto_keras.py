"""compression="auto" with Keras: re-planning at epoch ends (AdaptivePlanCallback), the same
plan on every rank, and the plan kept in a saved model."""

import os

import pytest

from spawn import run_gloo

pytestmark = pytest.mark.multiproc


def _keras_auto(rank, world, tmp):
    import numpy as np
    import keras
    import cgx.tensorflow.keras as hvd
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, activation="tanh"),
                              keras.layers.Dense(64), keras.layers.Dense(3)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01),
                                   compression=hvd.Compression.auto(window=2, adjust_every=1000))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(64, 16)).astype("float32") * (1 + rank)
    y = rng.normal(size=(64, 3)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.AdaptivePlanCallback()])
    made = [p.adaptive.plans_made for p in opt._exchange._plans.values()]
    ef = [p.error_feedback for p in opt._exchange._plans.values()]
    before = [(r["layer"], r["level"]) for r in opt.compression_plan()]
    path = os.path.join(tmp, f"model{rank}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    loaded.fit(x[:16], y[:16], batch_size=16, epochs=1, shuffle=False, verbose=0)
    after = [(r["layer"], r["level"]) for r in loaded.optimizer.compression_plan()]
    from cgx.policy.update_rule import update_rule_of
    rules = [update_rule_of(o).value for o in (
        keras.optimizers.SGD(0.1, momentum=0.9), keras.optimizers.AdamW(),
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))]
    return {"made": made, "before": before, "after": after, "ef": ef, "rules": rules}


def test_keras_replans_at_epoch_ends_and_saves_the_plan(tmp_path):
    outs = run_gloo(_keras_auto, 2, str(tmp_path))
    # 4 steps per epoch, window 2: plans at steps 2, then 6 and 10 (after epochs 1 and 2).
    assert outs[0]["made"] == outs[1]["made"] == [3]
    assert outs[0]["before"] == outs[1]["before"]
    assert any("bit" in level for _, level in outs[0]["before"])
    assert outs[0]["ef"] == [True]  # keras.optimizers.SGD: residuals kept (see compensation)
    # Keras optimizers' update rules (checked here, in a rank: TensorFlow stays out of
    # the test runner's own process).
    assert outs[0]["rules"] == ["linear", "adaptive", "adaptive"]
    for o in outs:
        # The loaded model continues with the saved plan (Keras names the same variable
        # "sequential/dense/kernel" or "dense/kernel", depending on how it was built).
        assert [lvl for _, lvl in o["after"]] == [lvl for _, lvl in o["before"]]
        assert all(a.endswith(b) or b.endswith(a)
                   for (a, _), (b, _) in zip(o["after"], o["before"])), o

