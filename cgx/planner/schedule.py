"""The planned exchange of one gradient list: trace, calibrate, plan, apply.

Timeline (``c`` = calibrate_steps)::

    steps [0, c)   the uniform quantized exchange; each gradient's ready time recorded
                   (from the step's first ready gradient: backward's start is not seen)
    step  c        every rank, at its first reduction of the step: the per-tensor ready
                   times are agreed (MAX over ranks), the link is measured (alpha-beta per
                   collective, the slowest rank's), the quantizer's throughput is agreed
                   (MIN over ranks), and the planner fixes each tensor's option

Every input of the planner is agreed over the ranks and the planner is deterministic,
so every rank holds the same plan: the ranks issue the same collectives.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from cgx.compression.planned import PlannedCompression
from cgx.config import ReductionType
from cgx.planner.costs import CostModel, TensorProfile
from cgx.planner.strategy import Plan, format_plan, plan

STATE_FORMAT = 1
_FAMILY = {ReductionType.SRA: "sra", ReductionType.RING: "sra",
           ReductionType.ALLGATHER: "allgather"}


class PlannedSchedule:
    """Ready times while calibrating, then the fixed per-tensor choice.

    Args:
        names, shapes: the gradients (plan order).
        specs: the quantized spec of each gradient the rules let compress (None: always exact).
        settings: the :class:`PlannedCompression` settings.
        algorithm: the reducer's compressed algorithm (the option the planner weighs).
        fusion_mb: the optimizer's bucket size (the fusion groups the planner assumes).
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]], specs: Sequence,
                 settings: PlannedCompression, algorithm: ReductionType = ReductionType.SRA,
                 fusion_mb: float = 64.0):
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.eligible = list(specs)
        self.settings = settings
        self.family = _FAMILY.get(algorithm, "sra")
        self.fusion_mb = float(fusion_mb)
        self.chosen: Optional[list[bool]] = None  # per tensor: compressed?
        self.plan: Optional[Plan] = None
        self._ready: list[list[float]] = [[] for _ in self.names]
        self._step_start: Optional[float] = None
        self._step_seen: Optional[int] = None

    # -- main thread: backward hooks ---------------------------------------------------
    def calibrating(self) -> bool:
        return self.chosen is None

    def note_ready(self, index: int, step: int) -> None:
        """Gradient ``index`` is ready (called from the backward hook)."""
        now = time.perf_counter()
        if step != self._step_seen:
            self._step_seen, self._step_start = step, now
        if step >= 1:  # step 0 warms up (allocations, first-call costs)
            self._ready[index].append(now - self._step_start)

    # -- engine thread ------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.chosen is None and step >= self.settings.calibrate_steps

    def specs(self) -> list:
        if self.chosen is None:
            return list(self.eligible)
        return [s if c else None for s, c in zip(self.eligible, self.chosen)]

    def replan(self, transport, verbose: bool = False) -> Plan:
        """Every rank at the same point: agree on the profile, measure, plan."""
        from cgx.comm.base import ReduceOp
        from cgx.planner.calibration import compressor_throughput, link_model
        n = len(self.names)
        local = torch.tensor([statistics.median(r) if r else 0.0 for r in self._ready] + [
            0.0, 0.0, 0.0], dtype=torch.float64)
        tp = compressor_throughput(numel=1 << 20, bits=self.settings.bits,
                                   bucket_size=self.settings.bucket_size, reps=2)
        # MAX over ranks: the latest ready time and the slowest quantizer (as 1/throughput)
        local[n:] = torch.tensor([1.0 / tp["compress_bps"], 1.0 / tp["decompress_bps"],
                                  1.0 / tp["cast_bps"]], dtype=torch.float64)
        agreed = local.to(transport.device)
        if transport.size > 1:
            transport.allreduce(agreed, ReduceOp.MAX)
        agreed = agreed.cpu().tolist()
        ready, inv = agreed[:n], agreed[n:]
        if self.settings.assume_gbit is not None:
            cost = CostModel.uniform(transport.size, self.settings.assume_gbit,
                                     compress_bps=1 / inv[0], decompress_bps=1 / inv[1],
                                     cast_bps=1 / inv[2])
        else:
            cost = CostModel(transport.size, link_model(transport), compress_bps=1 / inv[0],
                             decompress_bps=1 / inv[1], cast_bps=1 / inv[2])
        tensors = [TensorProfile(name, math.prod(shape), t)
                   for name, shape, t in zip(self.names, self.shapes, ready)]
        backward = max(ready) if ready else 0.0
        result = plan(tensors, cost, backward, fusion_mb=(self.fusion_mb,),
                      bits=(self.settings.bits,), families=("exact", self.family),
                      exact_only=[e is None for e in self.eligible])
        self.chosen = [e is not None and opt.name != "exact"
                       for e, opt in zip(self.eligible, result.chosen)]
        self.plan = result
        self._ready = [[] for _ in self.names]
        if verbose:
            print(f"cgx: planned exchange ({sum(self.chosen)} of {n} tensors compressed)\n"
                  + format_plan(result, limit=20), file=sys.stderr, flush=True)
        return result

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "names": list(self.names), "chosen": self.chosen}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"planned-exchange state of format {state.get('format')!r}; this "
                             f"version reads format {STATE_FORMAT}")
        if state["names"] != self.names:
            raise ValueError("the saved planned exchange is for other gradients "
                             f"({len(state['names'])} tensors, first {state['names'][:1]}) "
                             f"than this optimizer's ({len(self.names)}); restore it into the "
                             "same model")
        self.chosen = None if state["chosen"] is None else list(state["chosen"])
