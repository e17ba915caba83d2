"""The default: ``Compression.none`` (no ``compression=``, ``CGX_COMPRESSION`` unset) is the
deciding exchange in the torch optimizer, the DDP hook and the Keras optimizer, with its
default settings; ``CGX_COMPRESSION=quantize`` is fixed 4-bit; exchanges that cannot plan
the whole model send the fixed level under the default."""

from __future__ import annotations

import pytest
import torch

from cgx.compression import AutoCompression, Compression, fixed
from cgx.compression.auto_policy import default_policy
from cgx.compression.quantize import QuantizeCompressor
from cgx.config import AutoObjective, CompressionMode, Config
from spawn import run_gloo

# The default's trials (window 10, 3 warm-up steps, plans of a settling and 3 measured
# steps, up to 3 runoffs) end within about 60 steps on a small model.
STEPS = 80


@pytest.fixture
def default_env(monkeypatch):
    for name in ("CGX_COMPRESSION", "CGX_AUTO_OBJECTIVE", "CGX_AUTO_WINDOW"):
        monkeypatch.delenv(name, raising=False)


def test_unset_cgx_compression_means_the_deciding_exchange(default_env):
    cfg = Config.from_env()
    assert cfg.compression is CompressionMode.DECIDE
    policy = default_policy(cfg)
    assert isinstance(policy, AutoCompression) and policy.objective is AutoObjective.TIME
    assert (policy.alpha, policy.window) == (cfg.auto_alpha, cfg.auto_window)


def test_quantize_and_auto_keep_their_meaning():
    assert default_policy(Config(compression=CompressionMode.QUANTIZE)) is None
    auto = default_policy(Config(compression=CompressionMode.AUTO))
    assert auto.objective is AutoObjective.BYTES  # CGX_AUTO_OBJECTIVE's default
    timed = default_policy(Config(compression=CompressionMode.AUTO,
                                  auto_objective=AutoObjective.TIME))
    assert timed.objective is AutoObjective.TIME


def test_exact_stays_exact_under_every_mode():
    from cgx.policy import GradMode, resolve
    for mode in CompressionMode:
        assert resolve(Compression.exact(), Config(compression=mode)).mode is GradMode.EXACT
    decide = resolve(Compression.none(), Config())
    assert decide.mode is GradMode.AUTO and decide.compressor.objective is AutoObjective.TIME
    # quantization turned off: the default is exact, no trials (their budget would be 0)
    assert resolve(Compression.none(), Config(bits=32)).mode is GradMode.EXACT


def test_where_no_plan_can_be_made_the_default_sends_the_fixed_level():
    cfg = Config(bits=3, bucket_size=512, error_feedback=True)
    comp = fixed(Compression.none, cfg)
    inner = comp.compressor  # error feedback as CGX_COMPRESSION_ERROR_FEEDBACK says
    assert isinstance(inner, QuantizeCompressor) and (inner.bits, inner.bucket_size) == (3, 512)
    assert fixed(Compression.none, Config(bits=32)) is Compression.exact
    # anything but the default, and the default under quantize or auto, as given
    given = Compression.quantize(bits=8)
    assert fixed(given, cfg) is given
    assert fixed(Compression.none, cfg.replace(compression=CompressionMode.QUANTIZE)) \
        is Compression.none
    assert fixed(Compression.none, cfg.replace(compression=CompressionMode.AUTO)) \
        is Compression.none


def _torch(rank, world, adapter):
    import cgx.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, owner = net, None
    if adapter == "optimizer":
        opt = owner = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net, bucket_cap_mb=0.05)
        owner = hvd.CGXState(model)
        model.register_comm_hook(owner, hvd.cgx_hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
        opt.step()
    return {"rounds": owner.exchange_trials(),
            "params": [p.detach() for p in net.parameters()]}


@pytest.mark.multiproc
@pytest.mark.parametrize("adapter", ["optimizer", "ddp-hook"])
def test_the_torch_adapters_decide_by_default(default_env, adapter):
    a, b = run_gloo(_torch, 2, adapter)
    # a round, or more when the link probe moved under the machine's load
    assert len(a["rounds"]) >= 1 and a["rounds"] == b["rounds"]
    for r in a["rounds"]:
        labels = {p["label"] for p in r["plans"]}
        assert {"exact (fused)", "uniform 4-bit/1024"} <= labels and r["chosen"] in labels
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def _keras(rank, world):
    import numpy as np
    import keras
    import cgx.tensorflow.keras as hvd
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, activation="tanh"),
                              keras.layers.Dense(3)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(16 * STEPS, 16)).astype("float32")
    y = rng.normal(size=(16 * STEPS, 3)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {"rounds": opt.exchange_trials(), "weights": [w.numpy() for w in model.weights]}


@pytest.mark.multiproc
def test_the_keras_optimizer_decides_by_default(default_env):
    a, b = run_gloo(_keras, 2)
    assert len(a["rounds"]) >= 1 and a["rounds"] == b["rounds"]
    assert all(r["chosen"] in {p["label"] for p in r["plans"]} for r in a["rounds"])
    assert all((x == y).all() for x, y in zip(a["weights"], b["weights"]))


def _keras_factors(rank, world):
    import numpy as np
    import keras
    import cgx.tensorflow.keras as hvd
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(3)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), sufficient_factors=model)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(64, 16)).astype("float32")
    model.fit(x, x[:, :3], batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    from cgx.compression import resolve
    return {"sent": [type(resolve(c)).__name__ for c in (opt._exchange.compression,
                                                         opt._factors.compression)],
            "weights": [w.numpy() for w in model.weights]}


@pytest.mark.multiproc
def test_keras_sufficient_factors_under_the_default_send_the_fixed_level(default_env):
    a, b = run_gloo(_keras_factors, 2)
    # one layer at a time: no whole-model plan, the optimizer and the factor layers' plain
    # fallback both send uniform quantization
    assert a["sent"] == b["sent"] == ["QuantizeCompressor", "QuantizeCompressor"]
    assert all((x == y).all() for x, y in zip(a["weights"], b["weights"]))


def _diloco_warmup(rank, world):
    import cgx.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    opt = hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=4,
                     warmup_steps=3)
    return opt._loop.warmup_plan.mode.value


@pytest.mark.multiproc
def test_diloco_warmup_under_the_default_sends_the_fixed_level(default_env):
    # a warm-up of a few steps is too short for trials: uniform quantization, no plan
    assert run_gloo(_diloco_warmup, 2) == ["quantize", "quantize"]


def _resume_fixed_into_default(rank, world):
    import cgx.torch as hvd
    hvd.init()

    def make(comp):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        kw = {} if comp is None else {"compression": comp}
        return net, hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05,
                                                             momentum=0.9),
                                             named_parameters=net.named_parameters(), **kw)

    def train(net, opt, steps):
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            opt.zero_grad()
            net(torch.randn(8, 32, generator=g)).square().mean().backward()
            opt.step()

    old_net, old = make(hvd.Compression.quantize(bits=4))  # a run saved before the switch
    train(old_net, old, 3)
    net, opt = make(None)
    net.load_state_dict(old_net.state_dict())
    opt.load_state_dict(old.state_dict())
    train(net, opt, STEPS)
    return {"rounds": opt.exchange_trials(), "params": [p.detach() for p in net.parameters()]}


@pytest.mark.multiproc
def test_a_checkpoint_of_fixed_4bit_resumes_under_the_default(default_env):
    a, b = run_gloo(_resume_fixed_into_default, 2)
    assert len(a["rounds"]) >= 1 and a["rounds"] == b["rounds"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
