"""``compression="auto"`` over flat buffers: one level per sharded parameter group.

A sharded step (FSDP2, ZeRO) reduce-scatters one flat buffer per parameter group, so the
per-layer choice of :class:`cgx.policy.levels.AdaptiveSchedule` becomes a per-group choice:
each group is one "layer" of its buffer's size, offered the quantization levels (top-k
and PowerSGD do not reduce-scatter) and exact. The groups are found during the first
step (every rank reduce-scatters them in the same order); from then on the schedule runs
as for layers: the uniform default travels while each group's candidate errors are
measured over the ``window`` on this rank's input, the ranks combine the errors, and the
knapsack gives each group the level that sends the fewest bytes with the summed error
within ``alpha`` times the uniform default's.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from cgx.policy.levels.schedule import AdaptiveSchedule, default_candidate, offered_families
from cgx.compression.auto_policy import AutoCompression, Objective
from cgx.config import Config
from cgx.quant.codec import QuantSpec

STATE_FORMAT = 1


def quantize_only(settings: AutoCompression) -> AutoCompression:
    """``settings`` with quantization as the only family (a flat buffer's choices)."""
    if settings.objective is not Objective.BYTES:
        raise ValueError("Compression.auto(objective='time') is not available for sharded "
                         "groups; use the default objective ('bytes': the fewest bytes within "
                         "the error budget)")
    if "quantize" not in settings.families:
        raise ValueError(f"families={settings.families}: a sharded group's buffer is "
                         "reduce-scattered, which only quantization (and exact) can do; "
                         "include 'quantize'")
    out = copy.copy(settings)
    out.families = ("quantize",)
    return out


class GroupLevels:
    """Each parameter group's quantization level (None: exact), decided by auto's knapsack.

    Args:
        settings: the ``Compression.auto(...)`` settings (quantization levels only).
        config: the shared settings (the uniform default's level, rounding, threads).
        error_feedback: whether residuals are kept (the budget's families follow it).
    """

    def __init__(self, settings: AutoCompression, config: Config, error_feedback: bool):
        self.settings, self.config = quantize_only(settings), config
        self.error_feedback = error_feedback
        self.sizes: dict[str, int] = {}  # group -> buffer size, in first-step order
        self.schedule: Optional[AdaptiveSchedule] = None
        self._index: dict[str, int] = {}  # group -> its place in the schedule
        self._latest = -1  # the latest step seen (its first reduce-scatter re-plans)
        # the uniform default: what travels before the first plan
        d = default_candidate(offered_families(self.settings.families, error_feedback),
                              config, self.settings)
        self._default = d.spec(self.settings.rounding or config.rounding)

    def spec(self, name: str, step: int, x: torch.Tensor, transport) -> Optional[QuantSpec]:
        """The level group ``name``'s buffer ``x`` travels at ``step`` (every rank calls it
        at each reduce-scatter, in the same order: a re-plan here is a collective)."""
        if self.schedule is None and (step == 0 or name not in self.sizes):
            self.sizes.setdefault(name, x.numel())
            return None if step < self.settings.warmup_steps else self._default
        if self.schedule is None:
            self._build(step)
        sched = self.schedule
        if step > self._latest:  # the step's first reduce-scatter
            self._latest = step
            sched.measure_share(transport.rank, transport.size)
            if sched.due(step):
                sched.replan(step, transport, verbose=self.config.verbose)
        i = self._index.get(name)
        if i is None:  # a group first seen after the first step: the uniform default
            return self._default
        sched.observe(step, [i], [x.detach().reshape(-1)])
        c = sched.choices(step)[i]
        return None if c is None else c.spec(sched.rounding)

    def _build(self, step: int) -> None:
        """The schedule of the groups seen so far; its window starts at ``step`` (the steps
        before ran the uniform default unmeasured: the first, or a resumed run's first)."""
        names = list(self.sizes)
        self._index = {n: i for i, n in enumerate(names)}
        self.schedule = AdaptiveSchedule(names, [(self.sizes[n],) for n in names],
                                         [True] * len(names), self.settings, self.config,
                                         error_feedback=self.error_feedback)
        self.schedule.replan_soon(step)
        self._latest = step - 1

    def rows(self) -> list[dict]:
        """Per group: its level, bytes, error and share of the budget (``format_levels``)."""
        return [] if self.schedule is None else self.schedule.rows()

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "sizes": dict(self.sizes), "latest": self._latest,
                "schedule": None if self.schedule is None else self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a per-group auto state (format {state.get('format')!r})")
        self.sizes = {n: int(v) for n, v in state["sizes"].items()}
        self.schedule = None
        if state["schedule"] is not None:
            self._build(0)
            self.schedule.load_state_dict(state["schedule"])
        self._latest = int(state["latest"])
