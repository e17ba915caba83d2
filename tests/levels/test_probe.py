"""The compensation probe (cgx.policy.levels.probe): its sample, its shadow of the optimizer,
what it measures on gradients whose answer is known, the decision rule, and a schedule's
decisions kept through a checkpoint."""

from __future__ import annotations

import pytest
import torch

from cgx.policy.levels import probe
from cgx.policy.update_rule import Compensation, UpdateRule
from cgx.policy.levels.probe import (LayerProbe, ShadowUpdate, choose, measures, options_for,
                                sample_index)
from cgx.config import Rounding
from cgx.quant.codec import QuantSpec

NONE, CLASSIC, AVERAGE = (Compensation.NONE, Compensation.ERROR_FEEDBACK,
                          Compensation.MOVING_AVERAGE)


def test_sample_is_whole_buckets_spread_over_the_layer():
    assert sample_index(probe.PROBE_VALUES, 1024) is None  # small: the whole layer
    idx = sample_index(100_000, 1024)
    assert idx.numel() == (probe.PROBE_VALUES // 1024) * 1024
    starts = idx.view(-1, 1024)[:, 0]
    assert bool((starts % 1024 == 0).all())  # bucket-aligned
    assert torch.equal(idx.view(-1, 1024) - starts[:, None],
                       torch.arange(1024).expand(len(starts), -1))
    assert int(starts[0]) == 0 and int(idx.max()) < 100_000
    assert int(starts[-1]) > 100_000 // 2  # spread, not the first buckets only
    big_bucket = sample_index(10 * probe.PROBE_VALUES, 4 * probe.PROBE_VALUES)
    assert big_bucket.numel() == 4 * probe.PROBE_VALUES  # at least one bucket


@pytest.mark.parametrize("adaptive", [True, False])
def test_shadow_update_is_the_optimizers_step(adaptive):
    """Adam (lr 1, no weight decay) moves a parameter by minus the shadow's update; SGD
    with momentum 0.9 (lr 1) by minus its buffer."""
    p = torch.zeros(50, requires_grad=True)
    opt = torch.optim.Adam([p], lr=1.0, betas=probe.ADAM[:2], eps=probe.ADAM[2]) \
        if adaptive else torch.optim.SGD([p], lr=1.0, momentum=probe.MOMENTUM)
    shadow = ShadowUpdate(50, adaptive)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        grad = torch.randn(50, generator=g)
        before = p.detach().clone()
        p.grad = grad.clone()
        opt.step()
        assert torch.allclose(before - p.detach(), shadow.update(grad), rtol=1e-5, atol=1e-6)


def _measured(rule: UpdateRule, seed: int, n: int = 20_000, steps: int = 10):
    """2-bit stochastic rounding on gradients whose minibatch noise (heavy-tailed) is
    larger than their signal, as a network's are."""
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(n, generator=gen)
    p = LayerProbe(n, QuantSpec(2, 1024, Rounding.STOCHASTIC), rule, 0.95)
    for s in range(steps):
        noise = torch.randn(n, generator=gen) / torch.rand(n, generator=gen).clamp_min(0.05)
        p.step(0.3 * signal + 0.2 * noise, key=1000 * seed + s)
    return measures(p.sums_now())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adam_loses_progress_with_classic_feedback(seed):
    """Classic feedback doubles the error power in Adam's second moment: its path covers
    less of the true one than none's does, and the probe does not choose it."""
    m = dict(zip(probe.VARIANTS, _measured(UpdateRule.ADAPTIVE, seed)))
    assert m[CLASSIC][0] > m[NONE][0] + probe.SHORTFALL_TIE, m
    assert m[CLASSIC][1] < m[NONE][1]  # less noisy: progress decides, not noise
    assert choose(list(m.values()), options_for(None, None)) is not CLASSIC
    assert choose(list(m.values()), options_for(True, None)) is AVERAGE


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sgd_keeps_classic_feedback(seed):
    """SGD's update is linear: every compensation covers the true path, and classic
    feedback's errors telescope, so its path is the least noisy by far."""
    m = dict(zip(probe.VARIANTS, _measured(UpdateRule.LINEAR, seed)))
    assert all(v[0] < 0.05 for v in m.values()), m
    assert m[CLASSIC][1] < 0.3 * m[NONE][1], m
    assert choose(list(m.values()), options_for(None, None)) is CLASSIC


def test_choice_rule():
    # (shortfall, noise) per NONE, CLASSIC, AVERAGE
    assert choose([(0.10, 1.0), (0.10, 0.5), (0.10, 0.9)], options_for(None, None)) is CLASSIC
    # classic loses progress beyond the tie: the moving average, less noisy than none
    assert choose([(0.10, 1.0), (0.20, 0.1), (0.10, 0.9)], options_for(None, None)) is AVERAGE
    # a residual that cuts none's noise by no more than NOISE_TIE: none
    assert choose([(0.10, 1.0), (0.30, 0.1), (0.10, 0.99)], options_for(None, None)) is NONE
    # explicit error feedback: never none, whatever it measures
    assert choose([(0.0, 0.0), (0.3, 1.0), (0.2, 1.0)], options_for(True, None)) is AVERAGE
    # progress within SHORTFALL_TIE is a tie
    tie = probe.SHORTFALL_TIE / 2
    assert choose([(0.10, 1.0), (0.10 + tie, 0.2), (0.5, 0.1)], options_for(None, None)) is CLASSIC


def test_options():
    assert options_for(False, None) == (NONE,)
    assert set(options_for(None, None)) == {NONE, CLASSIC, AVERAGE}
    assert set(options_for(True, None)) == {CLASSIC, AVERAGE}
    assert options_for(True, CLASSIC) == (CLASSIC,)  # CGX_COMPENSATION names the form
    assert set(options_for(None, AVERAGE)) == {NONE, AVERAGE}


def test_a_layer_that_does_not_move_is_not_measured():
    p = LayerProbe(100, QuantSpec(4, 64), UpdateRule.ADAPTIVE, 0.95)
    assert measures(p.sums_now()) is None
    p.step(torch.zeros(100), key=1)
    assert measures(p.sums_now()) is None


def _schedule(options):
    from cgx.policy.levels.schedule import AdaptiveSchedule
    from cgx.compression.auto_policy import AutoCompression
    from cgx.config import Config
    return AdaptiveSchedule(["a", "b"], [(64, 64), (32, 64)], [True, True],
                            AutoCompression(window=4, adjust_every=8, families=("quantize",)),
                            Config(), compensations=options, update_rule=UpdateRule.LINEAR)


def test_schedule_decides_each_layer_and_a_checkpoint_keeps_it():
    from cgx.comm.base import SingleProcessTransport
    sched = _schedule(options_for(None, None))
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        assert sched.wants(step, 0) and sched.wants(step, 1)  # every window step
        sched.observe(step, [0, 1], [torch.randn(64, 64, generator=gen),
                                     torch.randn(32, 64, generator=gen)])
    assert sched.due(4)
    sched.replan(4, SingleProcessTransport())
    assert set(sched.compensation) == {"a", "b"}
    assert set(sched.compensation.values()) == {CLASSIC}  # SGD: classic (see above)
    assert [r["compensation"] for r in sched.rows()] == ["error_feedback"] * 2
    fresh = _schedule(options_for(None, None))
    fresh.load_state_dict(sched.state_dict())
    assert fresh.compensation == sched.compensation
    summary = _schedule(options_for(None, None))
    summary.load_plan_summary(sched.plan_summary())  # what a Keras checkpoint keeps
    assert summary.compensation == sched.compensation


def test_one_option_is_not_probed():
    sched = _schedule((CLASSIC,))
    assert not sched._probes_layer(0)
    sched.observe(0, [0], [torch.randn(64, 64)])
    assert not sched._probes


def _tied_lm(rank, world):
    import cgx.torch as hvd
    hvd.init()

    class TiedLM(torch.nn.Module):  # the embedding and the output layer share one weight
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(512, 64)
            self.mix = torch.nn.Linear(64, 64)
            self.head = torch.nn.Linear(64, 512, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, tokens):
            return self.head(torch.tanh(self.mix(self.emb(tokens).mean(1))))

    model = TiedLM()
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), named_parameters=model.named_parameters(),
        compression=hvd.Compression.auto(families=("quantize",), window=3, adjust_every=6))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(14):
        tokens = torch.randint(0, 512, (32, 6), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens), tokens[:, 0])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"rows": opt.compression_plan(), "losses": losses,
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiproc
def test_a_tied_weight_through_quantized_auto_and_the_probe_is_one_layer_on_every_rank():
    """Adam, error feedback left to the probe: the weight the embedding and the output layer
    share is planned once, quantized with a measured compensation, and every rank ends with
    the same parameters (a wrong per-use reduction or an unequal probe would part them)."""
    from spawn import run_gloo
    a, b = run_gloo(_tied_lm, 2)
    assert a["rows"] == b["rows"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    names = [r["layer"] for r in a["rows"]]
    assert names.count("emb.weight") == 1 and "head.weight" not in names, names
    tied = next(r for r in a["rows"] if r["layer"] == "emb.weight")
    assert tied["family"] == "quantize"
    assert tied["compensation"] in {c.value for c in (NONE, CLASSIC, AVERAGE)}, tied
    assert a["losses"][-1] < a["losses"][0]
