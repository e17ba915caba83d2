"""The planned mode's trials (``Compression.planned()``): time only, at one fixed level.

After each of the planner's plans, three plans take turns for a few steps: every tensor
exact in fused buckets (what DDP does), every tensor the rules allow at the fixed level
(what fixed quantization does), and the planner's per-tensor choice. The ranks agree on
the measured steps and the fastest is kept (ties within ``tie_tolerance``: fewer bytes, as its
plans carry no error),
so the planned mode is never slower than the two fixed choices it weighs, whatever the
model missed. There is no error budget beyond the fixed level: every plan is eligible.
A plan is one bool per tensor (quantized?). Linear layers sent as sufficient factors
(``sufficient_factors=``) follow the planner's per-layer choice in every plan.
"""

from __future__ import annotations

from cgx.policy.levels.candidates import Candidate, Family
from cgx.policy.trials.decider import TrialDecider
from cgx.policy.trials.proposals import Proposal, distinct, plan_bytes, predicted_step, select
from cgx.policy.trials.rounds import PlanRecord


class PlannedDecider(TrialDecider):
    """Trials of exact, uniform and the planner's plan of a :class:`PlannedSchedule`.

    Args:
        planned: the planner's schedule (its eligible specs, its last plan).
        settings: how long plans are tried and how the kept one is watched.
    """

    def proposals(self, transport) -> tuple[list[Proposal], float]:
        p = self.planned
        s = p.settings
        quantized = Candidate(Family.QUANTIZE, bits=s.bits, bucket_size=s.bucket_size)
        exact = Candidate(Family.EXACT)
        plans = [("exact (fused)", "exact", [False] * len(p.names)),
                 (f"uniform {s.bits}-bit/{s.bucket_size}", "uniform",
                  [e is not None for e in p.eligible]),
                 ("planner", "model", list(p.chosen))]
        out = []
        for label, kind, chosen in distinct(plans):
            cands = [None if e is None else (quantized if c else exact)
                     for e, c in zip(p.eligible, chosen)]
            out.append(Proposal(PlanRecord(label, kind, plan_bytes(cands, p.shapes, transport.size),
                                           0.0, predicted_step(cands, p.plan, p.family)),
                                chosen))
        return select(out, 1, self.trials.predicted), 0.0
