"""cgx.diloco without ranks: validation, the fragment schedule, the choice of H."""

import math

import pytest
import torch

from cgx.diloco import (DiLoCoConfig, FragmentSchedule, OuterSGD, balanced_fragments,
                        choose_sync_every, exchange_seconds)
from cgx.policy.planner.costs import CostModel
from cgx.quant.codec import QuantSpec
from cgx.quant.wire import packed_nbytes


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # 4 parameters


# -- bad input fails at construction --------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"sync_every": 0}, r"sync_every \(H\) must be an int >= 1"),
    ({"sync_every": -3}, r"sync_every \(H\) must be an int >= 1"),
    ({"sync_every": 2.5}, r"sync_every \(H\) must be an int >= 1, got 2.5 or 'auto'"),
    ({"sync_every": True}, r"sync_every \(H\)"),
    ({"sync_every": "often"}, r"sync_every \(H\)"),
    ({"fragments": 0}, r"fragments must be an int >= 1"),
    ({"fragments": 3, "sync_every": 2}, r"fragments=3 > sync_every=2"),
    ({"delay": 4, "sync_every": 4}, r"delay=4 must be < sync_every=4"),
    ({"delay": -1}, r"delay must be an int >= 0"),
    ({"warmup_steps": -1}, r"warmup_steps must be an int >= 0"),
    ({"mix": 1.0}, r"mix must be in \[0, 1\)"),
    ({"calibrate_steps": 0}, r"calibrate_steps must be an int >= 1"),
    ({"assume_gbit": 0}, r"assume_gbit must be > 0"),
])
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": 0}, r"outer learning rate must be > 0, got 0"),
    ({"lr": -0.7}, r"outer learning rate must be > 0"),
    ({"lr": "fast"}, r"outer lr must be a number"),
    ({"momentum": 1.0}, r"outer momentum must be in \[0, 1\)"),
    ({"momentum": 0.0}, r"Nesterov momentum needs momentum > 0"),
    ({"nesterov": 1}, r"nesterov must be True or False"),
    ({"follow_inner_lr": "yes"}, r"follow_inner_lr must be True or False"),
])
def test_bad_outer_optimizer_fails_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OuterSGD(**kwargs)


def test_outer_optimizer_must_be_outer_sgd_or_none():
    with pytest.raises(TypeError, match=r"outer_optimizer must be cgx.diloco.OuterSGD"):
        DiLoCoConfig(outer_optimizer=torch.optim.SGD)
    assert DiLoCoConfig(outer_optimizer=None).outer_optimizer is None


def test_torch_adapter_checks_at_construction():
    import cgx.torch as hvd
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"fragments=5 > the 4 trainable parameters"):
        hvd.DiLoCo(model, opt, sync_every=8, fragments=5)
    with pytest.raises(ValueError, match=r"sync_every \(H\) must be an int >= 1, got 0"):
        hvd.DiLoCo(model, opt, sync_every=0)
    with pytest.raises(ValueError, match=r"outer learning rate must be > 0"):
        hvd.DiLoCo(model, opt, outer_optimizer=hvd.OuterSGD(lr=0.0))
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer"):
        hvd.DiLoCo(model, "adam")
    with pytest.raises(ValueError, match=r"does not step \['1.weight'"):
        hvd.DiLoCo(model, torch.optim.SGD(model[0].parameters(), lr=0.1))


def test_defaults_are_the_papers():
    cfg = DiLoCoConfig()
    assert (cfg.sync_every, cfg.fragments, cfg.delay, cfg.warmup_steps) == (50, 1, 0, 0)
    assert cfg.outer_optimizer == OuterSGD(lr=0.7, momentum=0.9, nesterov=True,
                                           follow_inner_lr=False)
    comp = cfg.outer_compression()
    assert comp.compressor.bits == 4  # ErrorFeedback(QuantizeCompressor(4 bits))
    assert DiLoCoConfig(fragments=4).delay == 1  # streaming overlaps by default


# -- fragments -------------------------------------------------------------------------

@pytest.mark.parametrize("numels,k", [([10] * 7, 3), ([1000, 5, 5, 1000, 3], 2),
                                      ([1, 2, 3, 4, 5, 6, 7, 8, 9], 9), ([7], 1),
                                      ([4096, 64, 4096, 64, 10, 1], 4)])
def test_fragments_cover_every_parameter_once_and_balance(numels, k):
    groups = balanced_fragments(numels, k)
    assert len(groups) == k and all(groups)
    assert [i for g in groups for i in g] == list(range(len(numels)))
    sizes = [sum(numels[i] for i in g) for g in groups]
    # Contiguous cuts: no fragment exceeds its share by more than its largest tensor.
    assert max(sizes) <= sum(numels) / k + max(numels)


@pytest.mark.parametrize("k,h,start", [(1, 5, 0), (3, 7, 0), (4, 4, 2), (2, 50, 13)])
def test_each_fragment_syncs_once_in_every_round(k, h, start):
    sched = FragmentSchedule.make([3] * 6, k, h, delay=0, start=start)
    for first in range(start + 1, start + 3 * h):  # any window of H consecutive steps
        seen = [f for s in range(first, first + h) for f in sched.syncing(s)]
        assert sorted(seen) == list(range(k)), (first, seen)
    assert sched.syncing(start + h) == [k - 1]  # the last fragment at the round's end
    assert all(not sched.syncing(s) for s in range(0, start + 1))
    for s in range(start, start + 2 * h):
        nxt = sched.next_sync(s)
        assert sched.syncing(nxt) and not any(sched.syncing(t) for t in range(s + 1, nxt))


def test_too_many_fragments_is_refused():
    with pytest.raises(ValueError, match="cannot cut 2 parameters into 3"):
        balanced_fragments([4, 4], 3)


# -- sync_every="auto" ------------------------------------------------------------------

def test_exchange_seconds_follow_the_link_model():
    """One 4-bit tensor of n values over 2 ranks at 0.1 Gbit/s: SRA's all-to-all and
    all-gather each send half of the packed codes, plus the quantizer's time."""
    model = CostModel.uniform(2, 0.1, latency_s=1e-3)
    n, spec = 1_000_000, QuantSpec(4, 1024)
    wire = packed_nbytes(n // 2, 4, 1024)
    expect = 2 * (1e-3 + wire * 8 / 0.1e9) + 4 * n * 1.5 / model.compress_bps + \
        2 * 4 * n * 0.5 / model.decompress_bps
    assert exchange_seconds([n], [spec], model) == pytest.approx(expect, rel=1e-9)
    exact = 1e-3 + 4 * n * 8 / 0.1e9  # a ring allreduce sends 2 (P - 1) / P of 4 n bytes
    assert exchange_seconds([n], [None], model) == pytest.approx(exact, rel=1e-9)


def test_auto_takes_the_smallest_h_whose_exchange_hides():
    assert choose_sync_every([0.5], step_s=0.1) == 5
    assert choose_sync_every([0.51], step_s=0.1) == 6
    assert choose_sync_every([0.3, 0.3, 0.3], step_s=0.1, fragments=3) == 9
    assert choose_sync_every([0.001], step_s=0.1, fragments=4, delay=2) == 4  # >= K, delay+1
    assert choose_sync_every([1e3], step_s=0.01) == 1000  # capped
    assert choose_sync_every([0.5], step_s=0.1, min_sync_every=50) == 50  # an outer optimizer's
    assert choose_sync_every([9.0], step_s=0.1, min_sync_every=50) == 90
    # A slower link, or faster steps, need a longer round.
    model = CostModel.uniform(2, 0.1)
    n = [3_000_000]
    slow = exchange_seconds(n, [QuantSpec(4, 1024)], model)
    fast = exchange_seconds(n, [QuantSpec(4, 1024)], CostModel.uniform(2, 1.0))
    assert choose_sync_every([slow], 0.05) == math.ceil(slow / 0.05)
    assert choose_sync_every([slow], 0.05) > choose_sync_every([fast], 0.05)
    with pytest.raises(ValueError, match="step time must be > 0"):
        choose_sync_every([1.0], 0.0)


def test_benchmark_method_names():
    from benchmarks.timetoacc import methods
    for name in ("cgx-diloco-h50", "cgx-diloco-h7", "cgx-diloco-auto", "cgx-diloco-streaming",
                 "cgx-diloco-h50-followlr", "cgx-diloco-streaming-followlr",
                 "cgx-diloco-streaming-h10", "cgx-diloco-streaming-h2-followlr",
                 "cgx-localsgd", "cgx-localsgd-h20", "cgx-localsgd-streaming",
                 "cgx-localsgd-streaming-h10", "torch-postlocal-sgd",
                 "torch-postlocal-sgd-h10", "torchft-diloco", "torchft-diloco-h20",
                 "torchft-diloco-streaming", "torchft-diloco-streaming-h10"):
        assert methods.check(name) == name
    for bad in ("cgx-diloco-h0", "cgx-diloco", "cgx-diloco-fast", "torch-postlocal-sgd-h",
                "cgx-localsgd-h0", "cgx-localsgd-", "cgx-localsgd-followlr",
                "cgx-diloco-streaming-h1", "cgx-localsgd-streaming-h1",
                "cgx-localsgd-h10-streaming", "cgx-diloco-streaming-h",
                "torchft-diloco-h0", "torchft"):
        with pytest.raises(ValueError, match="unknown method"):
            methods.check(bad)
