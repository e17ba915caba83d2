"""The schedule's side of the compensation probe (:mod:`.probe`): the level a layer is
probed at, its probe's steps through the window, and the decision from every rank's probes.

The functions take the :class:`cgx.policy.levels.schedule.AdaptiveSchedule` (``s``) whose
probes (``s._probes``) and decisions (``s.compensation``) they keep; which rank probes which
layer is :func:`cgx.policy.levels.sampling.probes_layer`.
"""

from __future__ import annotations

import torch

from cgx.policy.levels import probe, stats
from cgx.policy.levels.candidates import Family

PROBE_SEED = 0x9E0B  # stochastic rounding noise of the compensation probe


def probe_spec(s, i: int):
    """The level the probe quantizes layer ``i`` at: its plan's, else the default's
    (None: neither quantizes)."""
    for c in (s.plan[i], s.default):
        if c is not None and c.family is Family.QUANTIZE:
            return c.spec(s.rounding)
    return None


def probe_step(s, step: int, i: int, g: torch.Tensor) -> None:
    """One window step of layer ``i``'s probe (made at its first step) on gradient ``g``."""
    p = s._probes.get(i)
    if p is None:
        p = s._probes[i] = probe.LayerProbe(g.numel(), probe_spec(s, i),
                                            s.update_rule, s.beta)
    p.step(g, stats.step_key(step, s.names[i]) ^ PROBE_SEED)


def decide_compensation(s, planned: list, transport) -> None:
    """Each probed layer's compensation from the window's probes of every rank (one
    allreduce; a collective when there are options to choose from)."""
    if len(s.compensation_options) < 2:
        return
    width = 1 + 2 * len(probe.VARIANTS)
    sums = [s._probes[i].sums_now() if i in s._probes else [0.0] * width for i in planned]
    rows = stats.combine(sums, [int(i in s._probes) for i in planned], transport)
    for i, row in zip(planned, rows):
        measured = probe.measures(row) if row is not None else None
        if measured is not None:
            s.compensation[s.names[i]] = probe.choose(measured, s.compensation_options)
