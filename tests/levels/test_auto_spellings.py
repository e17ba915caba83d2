"""Every spelling of auto that README shows (the string "auto", Compression.auto(...) and
CGX_COMPRESSION=auto) in every adapter, on real ranks; the DDP hook's error feedback follows
the optimizer it is given, and the caller's settings object is never changed."""

import os

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc

# CGX_COMPRESSION=auto with a short window: plans at steps 2, 6 and 10 of 12. The string
# "auto" is Compression.auto() (window 10: one plan, at step 10); the object plans like
# the environment.
ENV = {"CGX_COMPRESSION": "auto", "CGX_AUTO_WINDOW": "2", "CGX_AUTO_ADJUST_EVERY": "4"}
STEPS = 12
PLANS = {"env": 3, "string": 1, "object": 3}


def _spellings(hvd):
    return {"env": hvd.Compression.none, "string": "auto",
            "object": hvd.Compression.auto(window=2, adjust_every=4)}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :10].argmax(1)


def _torch_optimizer(rank, world):
    os.environ.update(ENV)
    import cgx.torch as hvd
    hvd.init()
    out = {}
    for spelling, comp in _spellings(hvd).items():
        model = _mlp()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       compression=comp)
        for step in range(STEPS):
            x, y = _batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[spelling] = {"plans": opt._plan.adaptive.plans_made,
                         "levels": [r["level"] for r in opt.compression_plan()],
                         "params": [p.detach().clone() for p in model.parameters()]}
    return out


def _ddp_hook(rank, world):
    os.environ.update(ENV)
    from torch.nn.parallel import DistributedDataParallel as DDP
    import cgx.torch as hvd
    out = {}
    for spelling, comp in _spellings(hvd).items():
        model = DDP(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = hvd.CGXState(model, compression=None if spelling == "env" else comp,
                             optimizer=opt)
        model.register_comm_hook(state, hvd.cgx_hook)
        for step in range(STEPS):
            x, y = _batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[spelling] = {"plans": state.plan.adaptive.plans_made,
                         "levels": [r["level"] for r in state.compression_plan()],
                         "params": [p.detach().clone() for p in model.parameters()]}
    return out


@pytest.mark.parametrize("adapter", ["optimizer", "ddp"])
def test_every_spelling_of_auto_plans_alike_on_every_rank_torch(adapter):
    outs = run_gloo(_torch_optimizer if adapter == "optimizer" else _ddp_hook, 2)
    for spelling, plans in PLANS.items():
        first = outs[0][spelling]
        assert first["plans"] == plans, (spelling, first["plans"])
        assert any("bit" in lv or "top" in lv or "rank" in lv for lv in first["levels"])
        assert outs[1][spelling]["levels"] == first["levels"]
        for p, q in zip(outs[1][spelling]["params"], first["params"]):
            assert torch.equal(p, q), spelling


def _ddp_error_feedback(rank, world, optimizer, env_ef):
    os.environ["CGX_COMPRESSION_ERROR_FEEDBACK"] = env_ef
    from torch.nn.parallel import DistributedDataParallel as DDP
    import cgx.torch as hvd
    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05) if optimizer == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    comp = hvd.Compression.auto(window=2, adjust_every=4, families=("quantize",))
    state = hvd.CGXState(model, compression=comp, optimizer=opt)
    forced = hvd.CGXState(model, compression=comp, optimizer=opt, error_feedback=True)
    model.register_comm_hook(state, hvd.cgx_hook)
    for step in range(4):
        x, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    rows = state.compression_plan()
    return {"ef": state.error_feedback, "held": sorted(state.plan.residuals.residuals),
            "quantized": {r["layer"]: r["compensation"] for r in rows
                          if r["family"] == "quantize"},
            "forced": forced.error_feedback, "user_object": comp.error_feedback}


@pytest.mark.parametrize("optimizer,env_ef", [("sgd", "0"), ("adamw", "1")])
def test_ddp_hook_auto_error_feedback_follows_the_optimizer(optimizer, env_ef):
    # The environment says the opposite of the optimizer's rule: the optimizer wins, as in
    # DistributedOptimizer; an explicit error_feedback= wins over both, and the user's
    # Compression.auto object is left as it was (error_feedback=None).
    # Each quantized layer's compensation is then measured (cgx.policy.levels.probe): it keeps
    # a residual where that is not "none"; a layer not measured keeps the rule's.
    default = "error_feedback" if optimizer == "sgd" else "none"
    for out in run_gloo(_ddp_error_feedback, 2, optimizer, env_ef):
        assert out["ef"] is (optimizer == "sgd"), out
        assert any(out["quantized"].values()), out
        assert out["held"] == sorted(n for n, c in out["quantized"].items()
                                     if (c or default) != "none"), out
        assert out["forced"] is True
        assert out["user_object"] is None


def _keras_model():
    import keras
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(128, activation="tanh"),
                             keras.layers.Dense(10)])


def _tape_loop(comp, x, y):
    """A custom loop with DistributedGradientTape(compression=comp); returns its plans
    made and the weights."""
    import keras
    import tensorflow as tf
    import cgx.tensorflow as hvd_tf
    model, inner, tapes = _keras_model(), keras.optimizers.SGD(0.01), []

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        tape = hvd_tf.DistributedGradientTape(tape, compression=comp)
        tapes.append(tape)  # at tracing: the exchange it holds is kept across steps
        inner.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    for s in range(STEPS):
        step(x[16 * s:16 * (s + 1)], y[16 * s:16 * (s + 1)])
    return {"plans": [p.adaptive.plans_made for p in tapes[-1]._exchange._plans.values()],
            "weights": [w.numpy() for w in model.weights]}


def _keras(rank, world):
    os.environ.update(ENV)
    import numpy as np
    import keras
    import cgx.tensorflow.keras as hvd
    hvd.init()
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(16 * STEPS, 32)).astype("float32")
    y = rng.normal(size=(16 * STEPS, 10)).astype("float32")
    out = {}
    for spelling, comp in _spellings(hvd).items():
        model = _keras_model()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=comp)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        out[f"keras-{spelling}"] = {
            "plans": [p.adaptive.plans_made for p in opt._exchange._plans.values()],
            "config": opt.get_config()["compression"]["type"],
            "weights": [w.numpy() for w in model.weights]}
        out[f"tape-{spelling}"] = _tape_loop(comp, x, y)
    return out


def test_every_spelling_of_auto_works_in_the_keras_optimizer_and_the_tape():
    outs = run_gloo(_keras, 2)
    for spelling, plans in PLANS.items():
        for adapter in ("keras", "tape"):
            first = outs[0][f"{adapter}-{spelling}"]
            assert first["plans"] == [plans], (adapter, spelling, first["plans"])
            for a, b in zip(outs[1][f"{adapter}-{spelling}"]["weights"], first["weights"]):
                assert (a == b).all(), (adapter, spelling)
        # The optimizer's config (what model.save keeps) says auto, for every spelling
        # but the environment's (there the environment decides again when loaded).
        assert outs[0][f"keras-{spelling}"]["config"] == ("none" if spelling == "env"
                                                          else "auto")


def test_ddp_hook_optimizer_must_be_a_torch_optimizer():
    import cgx.torch as hvd
    with pytest.raises(TypeError, match="torch.optim.Optimizer that applies the gradients"):
        hvd.CGXState(torch.nn.Linear(2, 2), compression="auto", optimizer="sgd")
