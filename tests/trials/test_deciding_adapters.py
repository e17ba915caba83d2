"""The deciding exchange (Compression.auto(objective="time")) in the other adapters: the
Keras optimizer (trials after the plans made at epoch ends) and the DDP communication hook;
every rank agrees on the trials and keeps the same plan."""

from __future__ import annotations

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc


def _keras(rank, world, mode="auto"):
    """Six epochs of model.fit with the deciding exchange (``mode="auto"``: plan at step 2,
    warm-up 3, then 3-5 plans x 2 steps, up to 3 runoff passes of at most as many: 45 steps
    at most; 60 run) or the planned mode's
    trials (``"planned"``: planned at step 2, warm-up 1, then 2 or 3 plans x 2 steps, up
    to 3 runoff passes of at most as many)."""
    import numpy as np
    import keras
    import cgx.tensorflow.keras as hvd
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, activation="tanh"),
                              keras.layers.Dense(64), keras.layers.Dense(3)])
    comp = hvd.Compression.auto(objective="time", window=2, trial_steps=1, recheck_every=0) \
        if mode == "auto" else hvd.Compression.planned(
            calibrate_steps=2, assume_gbit=0.01, replan_every=0, trial_steps=1,
            trial_warmup_steps=1)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=comp)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(160, 16)).astype("float32")
    y = rng.normal(size=(160, 3)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=6, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {"rounds": opt.exchange_trials(),
            "levels": [r["level"] for r in opt.compression_plan()],
            "weights": [w.numpy() for w in model.weights]}


def test_keras_agrees_on_the_trials_and_keeps_one_plan():
    a, b = run_gloo(_keras, 2)
    assert len(a["rounds"]) == 1 and a["rounds"] == b["rounds"]
    r = a["rounds"][0]
    labels = {p["label"] for p in r["plans"]}
    assert {"exact (fused)", "uniform 4-bit/1024"} <= labels and r["chosen"] in labels
    assert a["levels"] == b["levels"]
    assert all((x == y).all() for x, y in zip(a["weights"], b["weights"]))


def _ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    import cgx.torch as hvd
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=0.05)  # several buckets
    comp = hvd.Compression.auto(objective="time", window=2, trial_steps=1, recheck_every=0)
    state = hvd.CGXState(model, compression=comp)
    model.register_comm_hook(state, hvd.cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    # window 2, warm-up 3, 3-5 plans x 2 steps, up to 3 runoff passes of as many: 45 at most
    for _ in range(60):
        x = torch.randn(16, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
        opt.step()
    return {"rounds": state.exchange_trials(), "params": [p.detach() for p in model.parameters()]}


def test_ddp_hook_agrees_on_the_trials_and_keeps_one_plan():
    a, b = run_gloo(_ddp, 2)
    assert len(a["rounds"]) == 1 and a["rounds"] == b["rounds"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
