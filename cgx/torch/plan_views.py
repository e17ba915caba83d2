"""What an exchange decided, as its users ask for it: one mixin for the optimizer and the
DDP hook's state (both hold a :class:`cgx.exchange.plan.GradientPlan`)."""

from __future__ import annotations


class PlanViews:
    """The views of the gradient plan returned by :meth:`gradient_plan`."""

    def gradient_plan(self):
        raise NotImplementedError

    def compression_plan(self) -> list[dict]:
        """Per parameter: layer, shape, family, level, bytes, error and share of the error
        budget of the current plan (``compression="auto"``; else the fixed settings).

        Example::

            from cgx.policy.levels import format_levels
            print(format_levels(opt.compression_plan()))
        """
        return self.gradient_plan().compression_plan()

    def exchange_plan(self):
        """The planner's decision with ``compression=Compression.planned(...)``: a
        :class:`cgx.policy.planner.ExchangePlan` (``cgx.policy.planner.format_exchange`` prints it per tensor), or
        None while the first steps are traced (and in other modes). With trials, what
        travels is the plan they kept (:meth:`exchange_trials`; ``compression_plan()``
        lists its levels), which may be all exact or all quantized instead."""
        planned = self.gradient_plan().planned
        return planned.plan if planned is not None else None

    def exchange_checks(self) -> list:
        """With ``Compression.planned(trials=False)``: every drift check so far, as
        :class:`cgx.policy.planner.drift.DriftCheck` (step, predicted and measured step time,
        whether it re-planned). With trials (``Compression.planned()``,
        ``Compression.auto(objective="time")``): every check of a kept plan (step, its
        step and the link against the decision's, whether a new round started). Empty in
        other modes."""
        plan = self.gradient_plan()
        if plan.decider is not None:
            return [dict(c) for c in plan.decider.trials.checks]
        return list(plan.planned.checks) if plan.planned is not None else []

    def exchange_trials(self) -> list[dict]:
        """With ``Compression.auto(objective="time")`` or ``Compression.planned()``: every
        round of trials so far (see :meth:`cgx.policy.trials.TrialDecider.rounds`: the plans
        tried, measured and predicted step, bytes, error, the budget, the plan kept); empty
        in other modes."""
        decider = self.gradient_plan().decider
        return decider.rounds() if decider is not None else []
