"""The ranks split auto's window measurements: at a sampled step each layer is measured by
one rank (the layers dealt out by size), the deal turning from one sampled step to the next;
together the ranks measure what one rank measuring everything would."""

import pytest
import torch

from cgx.policy.levels import AdaptiveSchedule
from cgx.policy.levels.stats import measuring_ranks
from cgx.compression import Compression
from cgx.config import Config

NAMES = ["emb", "w1", "w2", "w3", "head", "bias"]
SHAPES = [(512, 64), (64, 64), (128, 64), (64, 32), (512, 64), (64,)]


def test_layers_are_dealt_largest_first_to_the_least_loaded_rank():
    sizes = [100, 60, 50, 40, 10, 0]
    deal = measuring_ranks(sizes, 2)
    assert deal == [0, 1, 1, 0, 1, 1]  # 100 | 60, 50 | 40 to rank 0, then 10 and 0 to rank 1
    loads = [sum(s for s, r in zip(sizes, deal) if r == k) for k in (0, 1)]
    assert abs(loads[0] - loads[1]) <= max(sizes)
    assert measuring_ranks(sizes, 1) == [0] * 6
    assert len(set(measuring_ranks(sizes, 8)[:5])) == 5  # more ranks than layers: one each


def _schedule(rank: int, world: int) -> AdaptiveSchedule:
    sched = AdaptiveSchedule(NAMES, SHAPES, [True] * 5 + [False],
                             Compression.auto(window=8, families=("quantize",)), Config())
    sched.measure_share(rank, world)
    return sched


def _window(sched: AdaptiveSchedule) -> dict:
    """Observe a window of 8 steps (samples at 0, 2, 4, 6) of the same gradients on every
    rank; per sampled step, the layers this rank measured."""
    measured = {}
    for step in range(8):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        before = dict(sched._counts)
        sched.observe(step, list(range(len(NAMES))), grads)
        measured[step] = {n for n in sched._counts if sched._counts[n] != before.get(n, 0)}
    return measured


def test_two_ranks_measure_each_layer_once_per_sampled_step_and_add_up_to_one_rank():
    alone, r0, r1 = _schedule(0, 1), _schedule(0, 2), _schedule(1, 2)
    full, m0, m1 = _window(alone), _window(r0), _window(r1)
    planned = set(NAMES[:5])
    for step in (0, 2, 4, 6):
        assert full[step] == planned
        assert m0[step] & m1[step] == set() and m0[step] | m1[step] == planned, step
        # the deal turns: what rank 0 measured at one sample, rank 1 measures at the next
        if step:
            assert m1[step] == m0[step - 2]
    for step in (1, 3, 5, 7):
        assert full[step] == m0[step] == m1[step] == set()
    # the same gradients on both ranks: their sums add up to the lone rank's, layer by layer
    for n in planned:
        assert r0._counts[n] + r1._counts[n] == alone._counts[n] == 4
        assert [a + b for a, b in zip(r0._sums[n], r1._sums[n])] == pytest.approx(
            alone._sums[n], rel=1e-12)  # (added in another order)
    # the work is split: each rank measured about half the values
    size = dict(zip(NAMES, [a * b for a, b in (s if len(s) == 2 else (s[0], 1)
                                                for s in SHAPES)]))
    work = [sum(size[n] for step in m for n in m[step]) for m in (m0, m1)]
    assert work[0] == work[1] == sum(size[n] for n in planned) * 4 // 2


def test_a_rank_reads_only_the_gradients_it_measures():
    r0 = _schedule(0, 2)
    reads = {step: [i for i in range(len(NAMES)) if r0.wants(step, i)] for step in range(8)}
    assert reads[1] == reads[3] == []
    deal = measuring_ranks([a * b for a, b in SHAPES[:5]] + [0], 2)
    assert reads[0] == [i for i in range(5) if deal[i] == 0]
    assert reads[2] == [i for i in range(5) if deal[i] == 1]


def test_a_rank_that_does_not_measure_a_layer_still_steps_its_powersgd_scorer():
    # the scorer's warm start follows the exchange's at every window step, on every rank
    shapes = [(64, 64), (64, 64)]
    scheds = []
    for rank in (0, 1):
        sched = AdaptiveSchedule(["a", "b"], shapes, [True, True],
                                 Compression.auto(window=8, families=("quantize", "powersgd")),
                                 Config())
        sched.measure_share(rank, 2)
        scheds.append(sched)
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for sched in scheds:
            assert sched.wants(step, 0) and sched.wants(step, 1)
            sched.observe(step, [0, 1], grads)
    a, b = (s.scorer.state_dict() for s in scheds)
    assert set(a["q"]) == set(b["q"]) == {"a", "b"}  # both ranks hold both warm starts...
    assert a["steps"] == b["steps"] == {"a": 8, "b": 8}  # ...stepped at every window step
    for n in ("a", "b"):
        assert torch.equal(a["q"][n], b["q"][n]), n  # ...to the same place
    for n in ("a", "b"):  # while each measured its share: together every sampled step
        assert scheds[0]._counts[n] + scheds[1]._counts[n] == 4
        assert scheds[0]._counts[n] == scheds[1]._counts[n] == 2
