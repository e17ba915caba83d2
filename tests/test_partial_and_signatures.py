"""Model-parallel pieces of horovod.tensorflow (PartialDistributedGradientTape,
register_local_source/var, BroadcastGlobalVariablesCallback(local_variables=...)) and the
argument lists of every Horovod function and class, against Horovod 0.28.1 itself."""

from __future__ import annotations

import importlib
import inspect

import pytest

from distutil import TESTS_DIR, run_ranks
from spawn import run_gloo

pytestmark = pytest.mark.multiproc

SCRIPT = str(TESTS_DIR / "side_by_side.py")
MODULES = {"horovod.torch": "cgx.torch", "horovod.tensorflow": "cgx.tensorflow",
           "horovod.tensorflow.keras": "cgx.tensorflow.keras",
           "horovod.tensorflow.keras.callbacks": "cgx.tensorflow.keras.callbacks"}
# Refused names take any arguments; their messages are tested in test_horovod_api.py.
REFUSED = {"SyncBatchNormalization", "broadcast_global_variables", "join"}


def test_partial_tape_matches_horovod(horovodrun):
    theirs = run_ranks(path=SCRIPT, nprocs=2, launcher="horovodrun", args=["horovod", "partial_tf"],
                       launcher_args=["--gloo"], timeout=240).check()
    mine = run_ranks(path=SCRIPT, nprocs=2, launcher="cgxrun-gloo", args=["cgx", "partial_tf"],
                     timeout=240).check()
    assert mine == theirs
    # The local layer's gradients differ between ranks; the shared layer's do not.
    assert mine[0]["grads_False"][0] == mine[1]["grads_False"][0]
    assert mine[0]["grads_False"][1] != mine[1]["grads_False"][1]
    assert [[g * 2 for g in row] for row in mine[0]["grads_True"][1]] == \
        mine[0]["grads_False"][1]
    assert mine[0]["split"] == [1, 1]


def _signature(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_horovod_argument_exists(module):
    try:
        hvd = importlib.import_module(module)
    except ImportError:
        pytest.fail(f"{module} does not import: `make test` builds Horovod (make horovod)")
    mine = importlib.import_module(MODULES[module])
    problems = []
    for name in dir(hvd):
        theirs = getattr(hvd, name)
        if name.startswith("_") or name in REFUSED or inspect.ismodule(theirs) or \
                not callable(theirs) or not hasattr(mine, name):
            continue
        ps, ours = _signature(theirs), _signature(getattr(mine, name))
        if ps is None or ours is None:
            continue
        if any(p.kind is p.VAR_KEYWORD for p in ours.values()) and \
                any(p.kind is p.VAR_POSITIONAL for p in ours.values()):
            continue  # a wrapper that forwards everything
        ours_names = [n for n in ours if n != "self"]
        theirs_pos = [n for n, p in ps.items() if n != "self" and p.kind in (
            p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and n not in ("args", "kwargs")]
        missing = [n for n in theirs_pos if n not in ours_names]
        if missing:
            problems.append(f"{name}: lacks {missing}")
            continue
        # Horovod's positional order holds for the arguments it has.
        ours_pos = [n for n in ours_names if n in theirs_pos]
        if ours_pos != theirs_pos:
            problems.append(f"{name}: positional order {ours_pos}, Horovod's {theirs_pos}")
    assert not problems, f"{MODULES[module]} differs from {module}:\n" + "\n".join(problems)


def _keras_local(rank, world):
    import numpy as np
    import keras
    import cgx.tensorflow.keras as hvd
    hvd.init()
    keras.utils.set_random_seed(rank)  # different initial weights on each rank
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(3, name="shared")
    local = keras.layers.Dense(1, name="local")
    model = keras.Model(inputs, local(shared(inputs)))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    for v in local.trainable_weights:
        opt.register_local_var(v)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(rank).normal(size=(16, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local.weights)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    out = {"shared": [w.tolist() for w in shared.get_weights()],
           "local": [w.tolist() for w in local.get_weights()]}
    # The tape form with Keras layers: the local layer's gradient is this rank's / size.
    import tensorflow as tf
    import cgx.tensorflow as hvd_tf
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x[:2]))
    plain = tape.gradient(loss, local.trainable_weights)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x[:2]))
    tape = hvd_tf.PartialDistributedGradientTape(tape, local_layers=[local])
    got = tape.gradient(loss, local.trainable_weights)
    out["partial_ok"] = all(np.allclose(g.numpy(), p.numpy() / world) for g, p in zip(got, plain))
    return out


def test_keras_local_variables_stay_per_rank():
    pytest.importorskip("cgx.tensorflow", exc_type=ImportError)
    a, b = run_gloo(_keras_local, 2)
    assert a["shared"] == b["shared"]  # broadcast, then averaged gradients: identical
    assert a["local"] != b["local"]    # never broadcast, never reduced
    assert a["partial_ok"] and b["partial_ok"]
