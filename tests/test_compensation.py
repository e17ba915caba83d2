"""Error compensation of the fused exchange: classic error feedback, and the moving average
that adaptive optimizers get with ``error_feedback=True``.

Unit behaviour without ranks (the reducer's part played by a local quantizer that does
what the fused reducer does with a residual buffer), the choice by the optimizer's update
rule, and the state a checkpoint keeps.
"""

from __future__ import annotations

import pytest
import torch

from cgx.policy.update_rule import Compensation, UpdateRule, compensation_for
from cgx.config import CompensationChoice, Config
from cgx.exchange.compensation import MovingAverage, bucket_clamp
from cgx.exchange.residuals import ResidualStore
from cgx.quant.codec import QuantSpec

BUCKET = 64


def _bucket_range(x: torch.Tensor, bucket: int):
    """Per value: the min and max of its bucket of ``x`` (the last bucket shorter)."""
    lo, hi = torch.empty_like(x), torch.empty_like(x)
    for s in range(0, x.numel(), bucket):
        lo[s:s + bucket], hi[s:s + bucket] = x[s:s + bucket].min(), x[s:s + bucket].max()
    return lo, hi


@pytest.mark.parametrize("n", [BUCKET, 1000, 7])
def test_bucket_clamp_keeps_corrected_values_in_the_bucket_range(n):
    g = torch.Generator().manual_seed(n)
    x, e = torch.randn(n, generator=g), 3 * torch.randn(n, generator=g)
    c = bucket_clamp(e, x, BUCKET)
    lo, hi = _bucket_range(x, BUCKET)
    assert bool(((x + c >= lo - 1e-6) & (x + c <= hi + 1e-6)).all())
    inside = (x + e >= lo) & (x + e <= hi)
    assert bool(inside.any()) and torch.equal(c[inside], e[inside])  # untouched when inside
    assert bool((c != e).any())  # the large ones were clipped


def _fake_reduce(work, specs, residuals):
    """What the fused reducer does with residual buffers, on one rank: add, quantize to
    the spec's bits per bucket (nearest level), leave what was dropped in the buffer."""
    for w, s, b in zip(work, specs, residuals):
        if b is None:
            continue
        v = w.view(-1) + b
        lo, hi = _bucket_range(v, s.bucket_size)
        unit = (hi - lo).clamp_min(1e-12) / (2 ** s.bits - 1)
        q = lo + torch.round((v - lo) / unit) * unit
        b.copy_(v - q)
        w.view(-1).copy_(q)


def _walk(compensation, steps=60, n=1000, seed=0, **kw):
    """``steps`` exchanges of one tensor through a store; the largest held value and the
    largest bucket range of the gradients seen."""
    store = ResidualStore(2.0, compensation, **kw)
    spec = QuantSpec(bits=2, bucket_size=BUCKET)
    g = torch.Generator().manual_seed(seed)
    worst, widest = 0.0, 0.0
    for _ in range(steps):
        w = torch.randn(n, generator=g) * 4 + 1
        widest = max(widest, float((w.max() - w.min()) / 2.0))  # input units (predivide 2)
        bufs = store.buffers([w], ["t"], [spec])
        _fake_reduce([w / 2.0], [spec], bufs)
        store.settle(["t"], bufs)
        worst = max(worst, float(store.residuals["t"].abs().max()))
    return store, worst, widest


def test_moving_average_residual_is_bounded_by_the_quantization_step():
    store, worst, widest = _walk(Compensation.MOVING_AVERAGE)
    # 2 bits: a value's error is at most one step (a third of its bucket's range); the
    # average of such errors stays within one step too
    assert 0 < worst <= widest / 3 + 1e-6
    assert store.residuals["t"].dtype == torch.float32


@pytest.mark.parametrize("beta", [0.0, 0.9])
def test_moving_average_follows_its_formula(beta):
    """buffer = clip(e) to the bucket's range of x; after: e = beta e + (1 - beta) q."""
    g = torch.Generator().manual_seed(3)
    spec = QuantSpec(bits=2, bucket_size=BUCKET)
    store = ResidualStore(1.0, Compensation.MOVING_AVERAGE, MovingAverage(beta=beta))
    for _ in range(4):
        w = torch.randn(1000, generator=g)
        e = store.residuals.get("t", torch.zeros(1000)).clone()
        lo, hi = _bucket_range(w, BUCKET)
        c = torch.minimum(torch.maximum(e, lo - w), hi - w)
        x = w.clone()
        bufs = store.buffers([x], ["t"], [spec])
        assert torch.allclose(bufs[0], c, atol=1e-6)
        _fake_reduce([x], [spec], bufs)
        q = bufs[0].clone()
        store.settle(["t"], bufs)
        assert torch.allclose(store.residuals["t"], beta * e + (1 - beta) * q, atol=1e-6)
        assert torch.allclose(x, w + c - q, atol=1e-5)  # what was sent


def test_moving_average_settings_are_checked():
    with pytest.raises(ValueError, match="beta"):
        MovingAverage(beta=1.0)
    with pytest.raises(ValueError, match="scale"):
        MovingAverage(scale=-0.5)


def test_state_round_trip_keeps_what_the_compensation_holds():
    store, _, _ = _walk(Compensation.MOVING_AVERAGE, steps=5)
    fresh = ResidualStore(2.0, Compensation.MOVING_AVERAGE)
    fresh.load_state_dict(store.state_dict(with_owed=False))
    assert torch.equal(fresh.residuals["t"], store.residuals["t"])
    assert fresh.residuals["t"] is not store.residuals["t"]
    # the loaded store goes on exactly as the original
    spec = QuantSpec(bits=2, bucket_size=BUCKET)
    w = torch.randn(1000, generator=torch.Generator().manual_seed(9))
    for s in (store, fresh):
        x = w.clone()
        bufs = s.buffers([x], ["t"], [spec])
        _fake_reduce([x], [spec], bufs)
        s.settle(["t"], bufs)
    assert torch.equal(fresh.residuals["t"], store.residuals["t"])


@pytest.mark.parametrize("ef,rule,choice,expected", [
    (True, UpdateRule.ADAPTIVE, CompensationChoice.AUTO, Compensation.MOVING_AVERAGE),
    (True, UpdateRule.LINEAR, CompensationChoice.AUTO, Compensation.ERROR_FEEDBACK),
    (True, UpdateRule.UNKNOWN, CompensationChoice.AUTO, Compensation.ERROR_FEEDBACK),
    (True, UpdateRule.ADAPTIVE, CompensationChoice.CLASSIC, Compensation.ERROR_FEEDBACK),
    (True, UpdateRule.LINEAR, CompensationChoice.MOVING_AVERAGE, Compensation.MOVING_AVERAGE),
    (False, UpdateRule.ADAPTIVE, CompensationChoice.AUTO, Compensation.NONE),
])
def test_compensation_follows_the_update_rule(ef, rule, choice, expected):
    assert compensation_for(ef, rule, choice) is expected


@pytest.mark.parametrize("make", [
    lambda C: C.quantize(bits=2, error_feedback=True),
    lambda C: C.auto(error_feedback=True),
])
def test_adamw_with_error_feedback_gets_the_moving_average(make):
    from cgx.compression import Compression
    from cgx.exchange import GradientPlan
    names, shapes = ["w", "b"], [(64, 48), (48,)]
    cfg = Config()
    adaptive = GradientPlan(names, shapes, make(Compression), config=cfg,
                            update_rule=UpdateRule.ADAPTIVE)
    linear = GradientPlan(names, shapes, make(Compression), config=cfg,
                          update_rule=UpdateRule.LINEAR)
    forced = GradientPlan(names, shapes, make(Compression), update_rule=UpdateRule.ADAPTIVE,
                          config=cfg.replace(compensation=CompensationChoice.CLASSIC))
    assert adaptive.residuals.compensation is Compensation.MOVING_AVERAGE
    assert linear.residuals.compensation is Compensation.ERROR_FEEDBACK
    assert forced.residuals.compensation is Compensation.ERROR_FEEDBACK


def test_config_reads_the_compensation_from_the_environment():
    assert Config.from_env({}).compensation is CompensationChoice.AUTO
    assert Config.from_env({"CGX_COMPENSATION": "classic"}).compensation is \
        CompensationChoice.CLASSIC
    from cgx.errors import ConfigError
    with pytest.raises(ConfigError, match="CGX_COMPENSATION"):
        Config.from_env({"CGX_COMPENSATION": "loco"})


def _adamw_ranks(rank, world):
    """Six AdamW steps with 2-bit quantization and error feedback on real ranks: the
    compensation, the parameters, and per step the largest held value against the
    largest bucket range of the local gradients (input units)."""
    import cgx.torch as hvd
    from cgx.config import Config
    hvd.init(Config(minimal_size=0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.quantize(
                                       bits=2, bucket_size=BUCKET, error_feedback=True))
    plan = opt._plan
    ratios = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
        widest = max(float((p.grad.max() - p.grad.min())) for p in model.parameters()
                     if p.dim() > 1)
        opt.step()
        held = max(float(plan.residual(n).abs().max()) for n in plan.names
                   if plan.residual(n) is not None)
        ratios.append(held / widest)
    params = torch.cat([p.detach().view(-1) for p in model.parameters()])
    return plan.residuals.compensation, params, ratios


@pytest.mark.multiproc
def test_adamw_ranks_use_the_moving_average_and_agree():
    from spawn import run_gloo
    results = run_gloo(_adamw_ranks, 2)
    for comp, params, ratios in results:
        assert comp is Compensation.MOVING_AVERAGE
        assert torch.equal(params, results[0][1])
        # held: an average of quantization errors, each within a 2-bit step of a bucket's
        # range (the owner's share of the sum's requantization counts the 2 ranks' sum),
        # started from zero six steps ago: at most (1 - beta^6) of such a step
        beta = MovingAverage().beta
        assert 0 < max(ratios) <= (1 - beta ** 6) * 2 / 3


def test_per_tensor_kinds_change_what_is_kept_and_owed():
    """Auto's measured choice per tensor (cgx.policy.levels.probe): a tensor whose compensation
    is none gets no buffer; leaving classic feedback owes its residual (added once to the
    next gradient, in gradient units); leaving the moving average drops it."""
    spec = QuantSpec(bits=2, bucket_size=BUCKET)
    store = ResidualStore(2.0, Compensation.ERROR_FEEDBACK)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        ws = [torch.randn(500, generator=g) for _ in range(3)]
        bufs = store.buffers(ws, ["a", "b", "c"], [spec] * 3)
        _fake_reduce([w / 2.0 for w in ws], [spec] * 3, bufs)
        store.settle(["a", "b", "c"], bufs)
    classic = store.residuals["a"].clone()
    store.set_kinds({"a": Compensation.NONE, "b": Compensation.MOVING_AVERAGE})
    assert store.keeps_any()
    assert "a" not in store.residuals and torch.equal(store.owed["a"], classic * 2.0)
    assert "b" in store.owed and "b" not in store.residuals  # b's average starts at zero
    w = [torch.randn(500, generator=g) for _ in range(3)]
    bufs = store.buffers(w, ["a", "b", "c"], [spec] * 3)
    assert bufs[0] is None and bufs[1] is not None and bufs[2] is store.residuals["c"]
    _fake_reduce([x / 2.0 for x in w], [spec] * 3, bufs)
    store.settle(["a", "b", "c"], bufs)
    assert bool(store.residuals["b"].abs().sum() > 0)
    owed_b = store.owed["b"].clone()
    store.set_kinds({"b": Compensation.NONE, "c": Compensation.NONE})
    assert "b" not in store.residuals and torch.equal(store.owed["b"], owed_b)  # not owed
    assert store.buffers(w, ["a", "b", "c"], [spec] * 3) == [None] * 3
    restored = ResidualStore(2.0, Compensation.ERROR_FEEDBACK)
    restored.load_state_dict(store.state_dict(with_owed=True))
    restored.set_kinds(store.compensator.kinds, restored=True)  # a checkpoint: nothing moves
    assert torch.equal(restored.owed["a"], store.owed["a"])
    assert restored.compensator.kinds == store.compensator.kinds
