"""Which window steps and layers a rank measures, and the measurements it adds up.

The ranks split the window's measurements instead of each measuring every layer
(``AdaptiveSchedule.measure_share``): at a sampled step each layer is measured by one
rank, the layers dealt out largest first to the least loaded rank
(:func:`stats.measuring_ranks`), and the deal turns by one rank at each sampled step, so
over a window a layer is measured on several ranks' gradients. A rank's measuring work per
window is 1/world of measuring every layer (the project's LM on 2 ranks: 4 sampled steps
of 50-70 ms instead of 100-140 ms); each layer's error is a mean over the window's sampled
steps, not over those steps times the ranks. (A layer that only some ranks use, a branch
taken on some ranks' inputs, is measured at the sampled steps dealt to them; dealt only to
ranks without its gradient, it keeps its level, as an unused layer does.)

The functions take the :class:`cgx.policy.levels.schedule.AdaptiveSchedule` (``s``) whose
window they read and whose measurements (``s._sums``, ``s._counts``) they keep: the
schedule declares that state; here is how a window fills it (:mod:`.stats` measures).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from cgx.policy.levels import probing, stats
from cgx.policy.levels.candidates import Family


def observing(s, step: int) -> bool:
    """Whether ``step`` is one of the window's steps."""
    return s.next_plan - s.settings.window <= step < s.next_plan


def turn(s, step: int) -> Optional[int]:
    """Which of the window's sampled steps ``step`` is (None: not one)."""
    return stats.sample_turn(step - (s.next_plan - s.settings.window), s.settings.window)


def sampled(s, step: int) -> bool:
    return turn(s, step) is not None


def powersgd_ranks(s, i: int) -> list[int]:
    """The PowerSGD ranks layer ``i`` may pick (its scorer iterates at every window step)."""
    cands = s.candidates[i] or ()
    return [c.rank for c in cands if c.family is Family.POWERSGD]


def deal(s, world: int) -> list:
    """Per layer, the rank that measures it at a window's first sampled step."""
    if world not in s._first_measurer:  # the work: a large layer's sample at most
        work = [0 if c is None else min(math.prod(shape), stats.SAMPLE_VALUES)
                for shape, c in zip(s.shapes, s.candidates)]
        s._first_measurer[world] = stats.measuring_ranks(work, world)
    return s._first_measurer[world]


def measures(s, step: int, i: int) -> bool:
    """Whether this rank measures layer ``i`` at ``step`` (a sampled step)."""
    rank, world = s.share
    if world <= 1:
        return True
    return (deal(s, world)[i] + turn(s, step)) % world == rank


def probes_layer(s, i: int) -> bool:
    """Whether this rank follows layer ``i``'s compensation probe through the window
    (the rank that measures it first; every window step)."""
    if len(s.compensation_options) < 2 or s.candidates[i] is None or \
            probing.probe_spec(s, i) is None:
        return False
    rank, world = s.share
    return world <= 1 or deal(s, world)[i] == rank


def wants(s, step: int, i: int) -> bool:
    """Whether ``observe`` at ``step`` reads gradient ``i``."""
    return (s.observing(step) and s.candidates[i] is not None
            and ((sampled(s, step) and measures(s, step, i))
                 or bool(powersgd_ranks(s, i)) or probes_layer(s, i)))


def observe(s, step: int, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
    """Measure this step's gradients (see ``AdaptiveSchedule.observe``)."""
    if not s.observing(step):
        return
    is_sampled = sampled(s, step)
    for i, g in zip(indices, grads):
        if not s.wants(step, i) or not bool(g.detach().any()):
            continue  # nothing to measure, or no gradient: nothing to learn
        cands, ranks = s.candidates[i], powersgd_ranks(s, i)
        name, g = s.names[i], g.detach().reshape(-1).to(torch.float32)
        follow, measure = probes_layer(s, i), is_sampled and measures(s, step, i)
        if (follow or measure) and not bool(torch.isfinite(g).all()):
            follow = measure = False
        if follow:
            probing.probe_step(s, step, i, g)
        low = s.scorer.step(name, g, s.shapes[i], ranks, measure) if ranks else None
        if not measure:  # (not finite: a loss-scaling overflow's step is not measured)
            continue
        errs = stats.candidate_errors(g, cands, rounding=s.rounding, threads=s.threads,
                                      key=stats.step_key(step, name), lowrank=low)
        old = s._sums.get(name)
        s._sums[name] = errs if old is None else [a + b for a, b in zip(old, errs)]
        s._counts[name] = s._counts.get(name, 0) + 1


def clear_window(s) -> None:
    """Forget the window's measurements (the warm start of the PowerSGD scorer stays)."""
    s._sums.clear()
    s._counts.clear()
    s._probes.clear()
